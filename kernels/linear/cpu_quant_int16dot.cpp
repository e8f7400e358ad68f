// Int16 dot products for the quantized linear's decode rows (cpu_quant_int8dot.cpp dispatches here
// where a call asks for 16-bit activations): 8-bit weight codes sign-extended to int16 in
// registers times activations quantized to int16 per 32 elements.
//
// Why: int8 activations (llama.cpp's Q8_0 x Q8_0) round each element by up to max|x| / 254 of its
// block, enough to move SmolLM2's greedy tokens off HF's on the same weights; int16 rounds by
// max|x| / 65534, 258x less, while still multiplying in integers: per 32 weights and activation
// row one vpdpwssd (32 int16 pairs into 16 int32 sums), a conversion and an FMA, where the fp32
// path converts and FMAs every 16 weights.
//
// Activations: per row and block of 32, d = max|x| / 32767, x_q = round_half_even(x / d) in
// [-32767, 32767]. Bounds: each int32 lane of one block holds 2 products (512-bit) or 4 (256-bit,
// two vpdpwssd), |q x_q| <= 128 * 32767, so |lane| <= 4 * 128 * 32767 < 2^24: exact in int32 and
// in its fp32 conversion. Then out += (s_w(g) * d) * lane sum, per block, in fp32.
// Mins (group sums of the quantized x, as the int8 path) and group 16 (two weight scales per
// block: lanes 0-7 hold elements 0-15) as in cpu_quant_int8dot.cpp.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_quant_int8dot.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define PAGODA_I16_X86 1
#endif

namespace {

constexpr int64_t kBlock = 32;

// The activation rows of one call, quantized: views into the calling thread's Scratch.
struct Act16 {
  int64_t M = 0, K = 0, nb = 0, ng = 0;
  const int16_t* s = nullptr;    // [M, K] x_q
  const float* d = nullptr;      // [M, K/32] the blocks' scales
  const float* gsum = nullptr;   // [M, ng] sum of x_q * d over each weight group (mins only)
  const int32_t* gof = nullptr;  // [K/32] the weight group of each block (group >= 32)
};

// The buffers behind Act16, one set per calling thread, kept between calls: a decode step makes
// ~120 calls, and four vectors allocated and freed per call (with the scalar rounding loop) were
// most of this path's extra cost per call (docs/quantization.md). They grow to the largest call
// seen (M <= 32 rows of K) and never shrink.
// The parallel_for's workers read them through Act16's pointers, never by name: a thread_local
// named inside the lambda is the *worker's* own (empty) copy, which is what gave the reverted
// per-thread-buffer attempt (75a1e9d) its NaN logits once N was large enough to split.
struct Scratch {
  std::vector<int16_t> s;
  std::vector<float> d, gsum;
  std::vector<int32_t> gof;
};

template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// One row's blocks, portable: d = max|x| / 32767, x_q = round_half_even(x / d) (nearbyint, the
// default rounding mode, as torch.round in the tests' reference).
void quantize_row(const float* x, int64_t nb, int16_t* s, float* d) {
  for (int64_t b = 0; b < nb; ++b, x += kBlock, s += kBlock) {
    float amax = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(x[k]));
    d[b] = amax / 32767.0f;
    const float id = d[b] != 0.0f ? 1.0f / d[b] : 0.0f;
    for (int64_t k = 0; k < kBlock; ++k)
      s[k] = static_cast<int16_t>(std::min(32767, std::max(-32767, static_cast<int>(std::nearbyint(x[k] * id)))));
  }
}

#ifdef PAGODA_I16_X86
// The same in vectors, bit for bit: the same max, the same fp32 product x * (1 / d), and a
// conversion that rounds by MXCSR (half to even unless someone changed the mode, as nearbyint).
// |x * id| <= 32767 up to an ulp; the clamp keeps the scalar loop's bounds for any input.
__attribute__((target("avx512f,avx512bw"))) void quantize_row512(const float* x, int64_t nb, int16_t* s, float* d) {
  const __m512i hi = _mm512_set1_epi32(32767), lo = _mm512_set1_epi32(-32767);
  for (int64_t b = 0; b < nb; ++b, x += kBlock, s += kBlock) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    d[b] = amax / 32767.0f;
    const __m512 id = _mm512_set1_ps(d[b] != 0.0f ? 1.0f / d[b] : 0.0f);
    const __m512i q0 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(v0, id))));
    const __m512i q1 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(v1, id))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s), _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + 16), _mm512_cvtepi32_epi16(q1));
  }
}

// AVX2 (the AVX-VNNI kernels' CPUs: no AVX-512 there).
__attribute__((target("avx2,fma"))) void quantize_row256(const float* x, int64_t nb, int16_t* s, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
  for (int64_t b = 0; b < nb; ++b, x += kBlock, s += kBlock) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    d[b] = _mm_cvtss_f32(m4) / 32767.0f;
    const __m256 id = _mm256_set1_ps(d[b] != 0.0f ? 1.0f / d[b] : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id))));
    // packs interleaves 128-bit lanes (a0-3 b0-3 a4-7 b4-7): the permute puts them back in order
    for (int i = 0; i < 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + 16 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8));
  }
}
#endif

// Quantizes x [M, K] into `buf` with the kernel family's instructions; returns the views.
Act16 quantize16(const float* x, int64_t M, int64_t K, int64_t group, bool sums, int64_t mode, Scratch& buf) {
  Act16 a;
  a.M = M, a.K = K, a.nb = K / kBlock, a.ng = K / group;
  int16_t* s = at_least(buf.s, M * K);
  float* d = at_least(buf.d, M * a.nb);
  int32_t* gof = at_least(buf.gof, a.nb);
  for (int64_t b = 0; b < a.nb; ++b) gof[b] = static_cast<int32_t>(b * kBlock / group);
  for (int64_t m = 0; m < M; ++m) {
#ifdef PAGODA_I16_X86
    if (mode == pagoda_cpu::kInt8DotAvx512Vnni) quantize_row512(x + m * K, a.nb, s + m * K, d + m * a.nb);
    else if (mode == pagoda_cpu::kInt8DotAvxVnni) quantize_row256(x + m * K, a.nb, s + m * K, d + m * a.nb);
    else quantize_row(x + m * K, a.nb, s + m * K, d + m * a.nb);
#else
    quantize_row(x + m * K, a.nb, s + m * K, d + m * a.nb);
#endif
  }
  if (sums) {  // mins' term: per half block (group 16 or a multiple of 32) the integer sum of x_q, times d
    float* gsum = at_least(buf.gsum, M * a.ng);
    std::fill(gsum, gsum + M * a.ng, 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t h = 0; h < 2 * a.nb; ++h) {
        const int16_t* sh = s + m * K + h * (kBlock / 2);
        int32_t sum = 0;
        for (int64_t k = 0; k < kBlock / 2; ++k) sum += sh[k];
        gsum[m * a.ng + h * (kBlock / 2) / group] += static_cast<float>(sum) * d[m * a.nb + h / 2];
      }
    a.gsum = gsum;
  }
  a.s = s, a.d = d, a.gof = gof;
  return a;
}

// What an output row adds to its dot products: bias[n] + the mins' term, mins[n, g] * sum(x_q d)
// over each group g (a.gsum), for activation row m.
inline float row_extra(const float* bias, const float* mins, const Act16& a, int64_t ng, int64_t n, int64_t m) {
  float extra = bias ? bias[n] : 0.0f;
  if (mins != nullptr) {
    float sum = 0.0f;
    for (int64_t g = 0; g < ng; ++g) sum += mins[n * ng + g] * a.gsum[m * ng + g];
    extra += sum;
  }
  return extra;
}

struct W16 {
  const int8_t* q;
  const float* scales;    // fp32 [N, ng], or nullptr where `half` holds them
  const uint16_t* half;   // fp16 [N, ng] (groups of 32, no mins: Q8_0 as stored), or nullptr
  const float* mins;      // nullptr: none
  int64_t N, K, group, ng;
};

#ifdef PAGODA_I16_X86
#define PAGODA_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define PAGODA_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// R weight rows from n against MT activation rows from m0: res[r * MT + j]. Per 32 weights and
// activation row: one vpdpwssd, a conversion and an FMA by the block's (weight scale * activation
// scale). SC kG32 (Q8_0, --quantization int8): those products for 16 blocks at a time, one vector
// multiply, stored and broadcast by the FMA's memory operand (no shuffle); kG16: two weight scales per block (lanes 0-7, 8-15);
// kAny: the block's group (a.gof).
enum Scales { kAny = 0, kG16 = 1, kG32 = 2 };

// 16 weight scales from index i (the live ones; 0 past them), fp16 widened exactly.
PAGODA_VNNI512 inline __m512 scales512(const W16& w, __mmask16 live, int64_t i) {
  return w.half != nullptr ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, w.half + i))
                           : _mm512_maskz_loadu_ps(live, w.scales + i);
}

template <int R, int MT, int SC>
PAGODA_VNNI512 void tile512(const W16& w, const Act16& a, int64_t n, int64_t m0, float* res) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b0 = 0; b0 < a.nb; b0 += 16) {  // windows of 16 blocks
    // kG32: s_w(b) * d_x(b) for the window's blocks, in memory: the FMA broadcasts it as its operand
    alignas(64) float prod[R][MT][16];
    if (SC == kG32) {
      const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, a.nb - b0)) - 1);
      for (int j = 0; j < MT; ++j) {
        const __m512 dx = _mm512_maskz_loadu_ps(live, a.d + (m0 + j) * a.nb + b0);
        for (int r = 0; r < R; ++r)
          _mm512_store_ps(prod[r][j], _mm512_mul_ps(scales512(w, live, (n + r) * w.ng + b0), dx));
      }
    }
    for (int64_t b = b0; b < std::min<int64_t>(b0 + 16, a.nb); ++b) {
      __m512i xs[MT];
      for (int j = 0; j < MT; ++j) xs[j] = _mm512_loadu_si512(a.s + (m0 + j) * a.K + b * kBlock);
      for (int r = 0; r < R; ++r) {
        const __m512i wq = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + (n + r) * w.K + b * kBlock)));
        const float* sc = SC == kG32 ? nullptr : w.scales + (n + r) * w.ng;  // kG32: `prod`
        for (int j = 0; j < MT; ++j) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(zero, wq, xs[j]));
          const float dx = a.d[(m0 + j) * a.nb + b];
          const __m512 scale = SC == kG32   ? _mm512_set1_ps(prod[r][j][b - b0])
                               : SC == kG16 ? _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sc[2 * b] * dx),
                                                                   _mm512_set1_ps(sc[2 * b + 1] * dx))
                                            : _mm512_set1_ps(sc[a.gof[b]] * dx);
          acc[r][j] = _mm512_fmadd_ps(dot, scale, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) res[r * MT + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// The same with 256-bit AVX-VNNI: two vectors of 16 per block; for G16 each is its own group.
template <int R, int MT, bool G16>
PAGODA_AVXVNNI void tile256(const W16& w, const Act16& a, int64_t n, int64_t m0, float* res) {
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i lo[MT], hi[MT];
    float dx[MT];
    for (int j = 0; j < MT; ++j) {
      const int16_t* xb = a.s + (m0 + j) * a.K + b * kBlock;
      lo[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
      hi[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
      dx[j] = a.d[(m0 + j) * a.nb + b];
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* qb = w.q + (n + r) * w.K + b * kBlock;
      const __m256i wlo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
      const __m256i whi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)));
      const float* sc = w.half == nullptr ? w.scales + (n + r) * w.ng : nullptr;  // fp16: groups of 32 only
      const float sg = G16 ? 0.0f : sc != nullptr ? sc[a.gof[b]] : _cvtsh_ss(w.half[(n + r) * w.ng + a.gof[b]]);
      for (int j = 0; j < MT; ++j) {
        if (G16) {
          const __m256 d0 = _mm256_cvtepi32_ps(_mm256_dpwssd_avx_epi32(zero, wlo, lo[j]));
          const __m256 d1 = _mm256_cvtepi32_ps(_mm256_dpwssd_avx_epi32(zero, whi, hi[j]));
          acc[r][j] = _mm256_fmadd_ps(d0, _mm256_set1_ps(sc[2 * b] * dx[j]), acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(d1, _mm256_set1_ps(sc[2 * b + 1] * dx[j]), acc[r][j]);
        } else {
          const __m256i dot = _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(zero, wlo, lo[j]), whi, hi[j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sg * dx[j]), acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][j]), _mm256_extractf128_ps(acc[r][j], 1));
      s = _mm_hadd_ps(s, s);
      s = _mm_hadd_ps(s, s);
      res[r * MT + j] = _mm_cvtss_f32(s);
    }
}

template <int R, int MT>
void emit(int64_t mode, const W16& w, const Act16& a, int64_t n, int64_t m0, const float* bias, float* out) {
  float res[R * MT];
  const bool g16 = w.group == 16;
  if (mode == pagoda_cpu::kInt8DotAvx512Vnni) {
    if (w.group == 32) tile512<R, MT, kG32>(w, a, n, m0, res);
    else if (g16) tile512<R, MT, kG16>(w, a, n, m0, res);
    else tile512<R, MT, kAny>(w, a, n, m0, res);
  } else {
    if (g16) tile256<R, MT, true>(w, a, n, m0, res);
    else tile256<R, MT, false>(w, a, n, m0, res);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j)
      out[(m0 + j) * w.N + n + r] = res[r * MT + j] + row_extra(bias, w.mins, a, w.ng, n + r, m0 + j);
}

// R weight rows from n against every activation row, in tiles of up to 4 (the rows stay in L1).
template <int R>
void block(int64_t mode, const W16& w, const Act16& a, int64_t n, const float* bias, float* out) {
  pagoda_cpu::for_row_tiles(a.M, [&](auto mt, int64_t m0) { emit<R, decltype(mt)::value>(mode, w, a, n, m0, bias, out); });
}

// Packed 4-, 5- and 6-bit codes (int16_dot_packed): each block of 32 codes is widened in registers
// to 32 int16 in element order -- 16 bytes of nibbles zero-extended, low then high nibbles; the
// fifth bit of element j (bit j of the plane) added as 16 under a mask; the sixth and fifth of
// Q6_K (bits 2j + 1, 2j of a 64-bit plane) under two masks that pext takes out; the zero point
// subtracted -- then, as the 8-bit path, one vpdpwssd, a conversion and an FMA per activation row.
struct Packed16 {
  const uint8_t* q;
  const float* scales;
  const float* mins;
  int64_t N, K, group, ng, bits, zero, row_bytes, block_bytes;
};

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,bmi2"))) inline __m512i unpack_codes(const uint8_t* blk,
                                                                                                 __m512i zero) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F))),
                                 _mm256_srli_epi16(bytes, 4), 1);
  if (BITS == 5) {
    uint32_t plane;
    std::memcpy(&plane, blk + 16, 4);
    v = _mm512_mask_add_epi16(v, static_cast<__mmask32>(plane), v, _mm512_set1_epi16(16));
  } else if (BITS == 6) {
    uint64_t plane;
    std::memcpy(&plane, blk + 16, 8);
    v = _mm512_mask_add_epi16(v, static_cast<__mmask32>(_pext_u64(plane, 0x5555555555555555ull)), v,
                              _mm512_set1_epi16(16));
    v = _mm512_mask_add_epi16(v, static_cast<__mmask32>(_pext_u64(plane, 0xAAAAAAAAAAAAAAAAull)), v,
                              _mm512_set1_epi16(32));
  }
  return _mm512_sub_epi16(v, zero);
}

// One weight row against MT activation rows: res[j]. G16: two scales per block (lanes 0-7, 8-15).
template <int BITS, int MT, bool G16>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,bmi2"))) void packed_tile512(const Packed16& w,
                                                                                          const Act16& a, int64_t n,
                                                                                          int64_t m0, float* res) {
  __m512 acc[MT];
  for (int j = 0; j < MT; ++j) acc[j] = _mm512_setzero_ps();
  const __m512i zero = _mm512_set1_epi16(static_cast<int16_t>(w.zero)), nil = _mm512_setzero_si512();
  const uint8_t* row = w.q + n * w.row_bytes;
  const float* sc = w.scales + n * w.ng;
  for (int64_t b = 0; b < a.nb; ++b) {
    const __m512i wq = unpack_codes<BITS>(row + b * w.block_bytes, zero);
    for (int j = 0; j < MT; ++j) {
      const __m512i xs = _mm512_loadu_si512(a.s + (m0 + j) * a.K + b * kBlock);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(nil, wq, xs));
      const float dx = a.d[(m0 + j) * a.nb + b];
      const __m512 scale = G16 ? _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sc[2 * b] * dx),
                                                      _mm512_set1_ps(sc[2 * b + 1] * dx))
                               : _mm512_set1_ps(sc[a.gof[b]] * dx);
      acc[j] = _mm512_fmadd_ps(dot, scale, acc[j]);
    }
  }
  for (int j = 0; j < MT; ++j) res[j] = _mm512_reduce_add_ps(acc[j]);
}

template <int BITS, bool G16>
void packed_rows(const Packed16& w, const Act16& a, int64_t begin, int64_t end, const float* bias, float* out) {
  for (int64_t n = begin; n < end; ++n)
    pagoda_cpu::for_row_tiles(a.M, [&](auto mt, int64_t m0) {
      constexpr int MT = decltype(mt)::value;
      float res[MT];
      packed_tile512<BITS, MT, G16>(w, a, n, m0, res);
      for (int j = 0; j < MT; ++j) out[(m0 + j) * w.N + n] = res[j] + row_extra(bias, w.mins, a, w.ng, n, m0 + j);
    });
}

// Row-interleaved codes (int16_dot_linear_interleaved): 16 weight rows at once, one output row per
// int32 lane. Per 32 weights of one activation row: one vpdpwssd multiplying an activation pair
// (broadcast) into 16 rows' pairs; per block of 32 and 16 rows: three adds, one conversion, one
// multiply and one FMA. Four accumulators break the vpdpwssd chain (latency ~5 cycles).
template <int MT>
PAGODA_VNNI512 void group512(const int8_t* q, const float* sf, const uint16_t* sh, const Act16& a, int64_t m0,
                             __m512* acc) {
  for (int j = 0; j < MT; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b, q += 16 * kBlock) {  // 16 rows x 32 codes = 512 bytes a block
    __m512i w[16];
    for (int i = 0; i < 16; ++i)
      w[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i)));
    const __m512 sw = sh != nullptr ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh + 16 * b)))
                                    : _mm512_loadu_ps(sf + 16 * b);
    for (int j = 0; j < MT; ++j) {
      const int32_t* xp = reinterpret_cast<const int32_t*>(a.s + (m0 + j) * a.K + b * kBlock);
      __m512i i0 = _mm512_setzero_si512(), i1 = i0, i2 = i0, i3 = i0;
      for (int i = 0; i < 16; i += 4) {
        i0 = _mm512_dpwssd_epi32(i0, w[i], _mm512_set1_epi32(xp[i]));
        i1 = _mm512_dpwssd_epi32(i1, w[i + 1], _mm512_set1_epi32(xp[i + 1]));
        i2 = _mm512_dpwssd_epi32(i2, w[i + 2], _mm512_set1_epi32(xp[i + 2]));
        i3 = _mm512_dpwssd_epi32(i3, w[i + 3], _mm512_set1_epi32(xp[i + 3]));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(i0, i1), _mm512_add_epi32(i2, i3));
      const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(a.d[(m0 + j) * a.nb + b]));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[j]);
    }
  }
}

template <int MT>
PAGODA_VNNI512 void group_tile512(const int8_t* q, const float* sf, const uint16_t* sh, const Act16& a, int64_t m0,
                                  int64_t n, int64_t N, const float* bias, float* out) {
  __m512 acc[MT];
  group512<MT>(q, sf, sh, a, m0, acc);
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  for (int j = 0; j < MT; ++j) _mm512_storeu_ps(out + (m0 + j) * N + n, _mm512_add_ps(acc[j], bv));
}

// One group of 16 weight rows against every activation row, in tiles of up to 4 (the group's
// 16 x K codes, 9-24 KB at SmolLM2's sizes, stay in L1 across the tiles).
void group_rows512(const int8_t* q, const float* sf, const uint16_t* sh, const Act16& a, int64_t n, int64_t N,
                   const float* bias, float* out) {
  pagoda_cpu::for_row_tiles(a.M, [&](auto mt, int64_t m0) {
    group_tile512<decltype(mt)::value>(q, sf, sh, a, m0, n, N, bias, out);
  });
}
#endif

}  // namespace

namespace pagoda_cpu {

bool int16_dot_linear(int64_t mode, const float* x, int64_t M, int64_t K, const int8_t* q, const float* scales,
                      const float* mins, int64_t N, int64_t group, const float* bias, float* out,
                      const uint16_t* half_scales) {
  if (mode == kInt8DotOff || K % kBlock != 0 || (group % kBlock != 0 && group != 16)) return false;
  if (half_scales != nullptr && (group != kBlock || mins != nullptr)) return false;
#ifdef PAGODA_I16_X86
  thread_local Scratch scratch;  // this caller's; the workers below see it through `a` only
  const Act16 a = quantize16(x, M, K, group, mins != nullptr, mode, scratch);
  const W16 w{q, scales, half_scales, mins, N, K, group, K / group};
  // 4 weight rows at a time at M = 1 (sharing each activation load), 2 above, then one at a time
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    if (M == 1)
      for (; n + 4 <= end; n += 4) block<4>(mode, w, a, n, bias, out);
    else
      for (; n + 2 <= end; n += 2) block<2>(mode, w, a, n, bias, out);
    for (; n < end; ++n) block<1>(mode, w, a, n, bias, out);
  });
  return true;
#else
  return false;
#endif
}

bool int16_dot_linear_interleaved(int64_t act, const float* x, int64_t M, int64_t K, const int8_t* q,
                                  const float* scales, const uint16_t* half_scales, int64_t N, const float* bias,
                                  float* out) {
  if (act == kActDefault) act = act_default();
  if (int8_dot_mode() != kInt8DotAvx512Vnni || act != kActInt16 || K % kBlock != 0 || N % 16 != 0) return false;
#ifdef PAGODA_I16_X86
  thread_local Scratch scratch;  // as int16_dot_linear: the workers read it through `a` only
  const Act16 a = quantize16(x, M, K, kBlock, false, kInt8DotAvx512Vnni, scratch);
  const int64_t nb = K / kBlock;
  // groups of 16 rows; 4 groups (64 rows) a task at least, as the row-major path
  at::parallel_for(0, N / 16, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      group_rows512(q + g * 16 * K, half_scales ? nullptr : scales + g * nb * 16,
                    half_scales ? half_scales + g * nb * 16 : nullptr, a, g * 16, N, bias, out);
  });
  return true;
#else
  return false;
#endif
}

bool int16_dot_packed(const float* x, int64_t M, int64_t K, const uint8_t* q, int64_t bits, int64_t zero,
                      const float* scales, const float* mins, int64_t N, int64_t group, const float* bias,
                      float* out) {
  if (int8_dot_mode() != kInt8DotAvx512Vnni || act_default() != kActInt16 || K % kBlock != 0) return false;
  if (!(bits == 4 ? group == kBlock : (bits == 5 || bits == 6) && (group == 16 || group % kBlock == 0))) return false;
#ifdef PAGODA_I16_X86
  thread_local Scratch scratch;  // as int16_dot_linear: the workers read it through `a` only
  const Act16 a = quantize16(x, M, K, group, mins != nullptr, kInt8DotAvx512Vnni, scratch);
  const int64_t block_bytes = 16 + 4 * (bits - 4);  // nibbles, then the top bits (none for 4 bits)
  const Packed16 w{q, scales, mins, N, K, group, K / group, bits, zero, K / kBlock * block_bytes, block_bytes};
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    const bool g16 = group == 16;
    if (bits == 4) packed_rows<4, false>(w, a, begin, end, bias, out);
    else if (bits == 5) g16 ? packed_rows<5, true>(w, a, begin, end, bias, out) : packed_rows<5, false>(w, a, begin, end, bias, out);
    else g16 ? packed_rows<6, true>(w, a, begin, end, bias, out) : packed_rows<6, false>(w, a, begin, end, bias, out);
  });
  return true;
#else
  return false;
#endif
}

}  // namespace pagoda_cpu
