// FP8 (e4m3fn, e5m2) <-> fp32 for the CUDA kernels, in integer bit operations that compile
// unchanged as host C++ (tests/unit/test_fp8_codec.py builds this file with g++ and checks every
// code and a sweep of floats against torch's float8 dtypes).
//
// Semantics are torch's `.to(torch.float8_e4m3fn / float8_e5m2)` (c10/util/Float8_*.h), which the
// torch and CPU backends use to write FP8 caches, so all three backends store identical bytes:
// round to nearest even; e4m3fn saturates finite overflow and +-inf to +-448 (it has no inf);
// e5m2 overflows to +-inf (it is an fp16 with 2 mantissa bits); NaN stays NaN, sign kept.
//
// Decode goes through fp16 bits: an e5m2 byte is the top byte of an fp16, and an e4m3fn byte
// shifted into fp16's layout is an fp16 worth exactly x * 2^-8 (subnormals included: fp16's
// exponent range covers e4m3's). One fp16->fp32 conversion then finishes the job, with no fp32
// denormal on the way (the kernels run with -ftz=true). The 2^8 is folded into the per-tensor
// scale by the caller (Fp8Format::kDecodeUnit), so it costs nothing per element.
//
// The NVRTC sources include this file textually (kernels/nvrtc.py expands quoted #includes), so
// CuPy's source-keyed disk cache sees its changes.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define PAGODA_HD __host__ __device__ __forceinline__
#else
#include <cstdint>
#include <cstring>
#define PAGODA_HD inline
#endif

namespace pagoda {
namespace fp8 {

typedef unsigned int u32;

PAGODA_HD u32 bits_of(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    u32 u;
    std::memcpy(&u, &x, sizeof u);
    return u;
#endif
}

PAGODA_HD float float_of(u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
#endif
}

// fp16 bits -> fp32. On the device: the hardware conversion (cvt.f32.f16, exact). On the host: the
// same exact conversion in integers, so the host test checks everything around it.
PAGODA_HD float half_bits_to_float(u32 h) {
#ifdef __CUDA_ARCH__
    return __half2float(__ushort_as_half((unsigned short)h));
#else
    const u32 sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1fu) return float_of(sign | 0x7f800000u | (mant << 13));  // inf / NaN
    if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
    const float sub = (float)mant * 5.9604644775390625e-08f;  // mant * 2^-24, exact
    return sign ? -sub : sub;
#endif
}

// One FP8 code (low 8 bits of `b`) -> the fp16 bits of its value times Format::kDecodeUnit^-1.
struct E4m3 {
    static constexpr float kDecodeUnit = 256.0f;  // decoded value = half(bits) * 2^8
    static PAGODA_HD u32 to_half_bits(u32 b) {
        const u32 em = b & 0x7fu;
        // 0x7f / 0xff are e4m3fn's only NaNs; everything else is finite.
        return em == 0x7fu ? 0x7e00u : (((b & 0x80u) << 8) | (em << 7));
    }
    // torch's fp8e4m3fn_from_fp32_value, line for line.
    static PAGODA_HD u32 from_float(float f) {
        const u32 fp8_max = 1087u << 20;     // 480.0f: the first value past 448
        const u32 denorm_mask = 141u << 23;  // ((127 - 7) + (23 - 3) + 1) << 23
        u32 f_bits = bits_of(f);
        const u32 sign = f_bits & 0x80000000u;
        f_bits ^= sign;
        u32 result;
        if (f_bits >= fp8_max) {
            result = f_bits > 0x7f800000u ? 0x7fu : 0x7eu;  // NaN stays NaN; overflow saturates
        } else if (f_bits < (121u << 23)) {  // below 2^-6: the fp32 add rounds into a subnormal
            result = (bits_of(float_of(f_bits) + float_of(denorm_mask)) - denorm_mask) & 0xffu;
        } else {
            const u32 mant_odd = (f_bits >> 20) & 1u;
            f_bits += ((u32)(7 - 127) << 23) + 0x7ffffu;
            f_bits += mant_odd;  // round to nearest even
            result = (f_bits >> 20) & 0xffu;
            if (result == 0x7fu) result = 0x7eu;  // a carry into the NaN pattern saturates
        }
        return result | (sign >> 24);
    }
};

struct E5m2 {
    static constexpr float kDecodeUnit = 1.0f;  // an e5m2 byte is the top byte of an fp16
    static PAGODA_HD u32 to_half_bits(u32 b) { return (b & 0xffu) << 8; }
    // torch's fp8e5m2_from_fp32_value, line for line.
    static PAGODA_HD u32 from_float(float f) {
        const u32 fp32_inf = 255u << 23;
        const u32 fp8_max = 143u << 23;      // 65536.0f
        const u32 denorm_mask = 134u << 23;  // ((127 - 15) + (23 - 2) + 1) << 23
        u32 f_bits = bits_of(f);
        const u32 sign = f_bits & 0x80000000u;
        f_bits ^= sign;
        u32 result;
        if (f_bits >= fp8_max) {
            result = f_bits > fp32_inf ? 0x7fu : 0x7cu;  // NaN, or overflow to inf
        } else if (f_bits < (113u << 23)) {  // below 2^-14
            result = (bits_of(float_of(f_bits) + float_of(denorm_mask)) - denorm_mask) & 0xffu;
        } else {
            const u32 mant_odd = (f_bits >> 21) & 1u;
            f_bits += ((u32)(15 - 127) << 23) + 0xfffffu;
            f_bits += mant_odd;
            result = (f_bits >> 21) & 0xffu;
        }
        return result | (sign >> 24);
    }
};

// x * inv_scale, the value an FP8 cache stores, keeping a NaN's bits: a GPU multiply returns the
// canonical (positive) NaN, while torch keeps the sign, and torch's fp32 -> bf16 makes NaNs negative
// (0xffff), so a NaN row would otherwise be stored as 0x7f where torch stores 0xff. Integer test:
// it survives --use_fast_math.
PAGODA_HD float scaled_for_encode(float x, float inv_scale) {
    return (bits_of(x) & 0x7fffffffu) > 0x7f800000u ? x : x * inv_scale;
}

// Exact decode of one code to fp32 (the value torch's float8 -> float gives).
template <typename Format>
PAGODA_HD float decode(u32 b) {
    return half_bits_to_float(Format::to_half_bits(b)) * Format::kDecodeUnit;
}

}  // namespace fp8
}  // namespace pagoda
