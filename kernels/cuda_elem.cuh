// Element types shared by the CUDA kernels (device-only; included after cuda_fp16.h/cuda_bf16.h).
// Elem<T>: the 2-byte activation/cache types <-> fp32. fp8_e4m3 / fp8_e5m2: one-byte cache element
// tags (--kv-cache-dtype fp8 / fp8_e5m2), stored as raw bytes and converted by fp8.cuh.
#pragma once
#include "fp8.cuh"

namespace pagoda {

// Two 2-byte elements packed in a 32-bit word -> two floats.
template <typename T> struct Elem;
template <> struct Elem<__half> {
    static __device__ __forceinline__ void unpack(unsigned w, float& lo, float& hi) {
        lo = __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
        hi = __half2float(__ushort_as_half((unsigned short)(w >> 16)));
    }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <> struct Elem<__nv_bfloat16> {
    static __device__ __forceinline__ void unpack(unsigned w, float& lo, float& hi) {
        lo = __uint_as_float(w << 16);  // bf16 is the top half of an fp32
        hi = __uint_as_float(w & 0xffff0000u);
    }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// Eight 2-byte elements in one 16-byte vector -> eight floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
    Elem<T>::unpack(raw.x, f[0], f[1]);
    Elem<T>::unpack(raw.y, f[2], f[3]);
    Elem<T>::unpack(raw.z, f[4], f[5]);
    Elem<T>::unpack(raw.w, f[6], f[7]);
}

struct fp8_e4m3 { unsigned char bits; };
struct fp8_e5m2 { unsigned char bits; };

template <typename C> struct Fp8Format;
template <> struct Fp8Format<fp8_e4m3> { typedef fp8::E4m3 type; };
template <> struct Fp8Format<fp8_e5m2> { typedef fp8::E5m2 type; };

// Four FP8 codes in a 32-bit word -> four floats, each the code's value / Format::kDecodeUnit.
template <typename Format>
__device__ __forceinline__ void fp8x4_to_float(unsigned w, float* f) {
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = fp8::half_bits_to_float(Format::to_half_bits(w >> (8 * j)));
}

}  // namespace pagoda
