// Weight-only quantized linear on CPU: torch op `pagoda_cpu::quant_linear` (worker_svc/models/quant_linear.py).
//
// Weights stay int8 / packed int4 in memory and are widened to fp32 only in registers (decode) or in
// a small scratch block of rows (prefill); see docs/quantization.md for the formats.
//
//   qweight: int8 [N, K]            (bits 8)  or uint8 [N, K/2] (bits 4: in each group of `group`
//            elements, byte i holds element i in its low nibble and element i + group/2 in its high
//            one: GGUF's Q4_0/Q4_1 block layout)
//   scales:  fp32 [N, K/group] (or fp16 for 8-bit codes in groups of 32 without mins: Q8_0 as stored,
//            read as such by the integer dot paths, widened to an fp32 copy per call by the others);
//   mins: fp32 [N, K/group] or undefined
//   w[n, k] = scales[n, g] * float(q[n, k] - zero) (+ mins[n, g])   with g = k / group
//
// The product and the sum are two roundings, exactly as gguf's numpy reference dequantises
// (d * q - dm), so every weight the kernel multiplies is bit-identical to gguf.quants.dequantize.
//
// Small M (decode, M <= kMaxDirectRows): rows of W are split over torch's threads and read once per
// step. 8-bit codes on a CPU with VNNI go through int8 dot products over activations quantized to
// int16 (the default) or int8 per 32 (cpu_quant_int8dot.cpp; `act` per call, PAGODA_INT8_DOT). Otherwise, on AVX-512 CPUs each group is widened in registers and multiplied straight into the
// activation rows' accumulators (the fused path below); elsewhere each row is dequantised into an L1
// buffer and dotted with every activation row (4 at a time). Larger M (prefill): blocks of rows are dequantised into a scratch
// fp32 matrix and multiplied by at::mm (MKL / oneDNN), which is compute bound there anyway.
// Activations fp32 or bf16 (bf16 is widened once; the output comes back in the activation dtype).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "cpu_quant_int8dot.h"
#include "cpu_quant_blocked.h"
#include "cpu_quant_gemm16.h"
#include "cpu_quant_linear.h"
#include "cpu_quant_linear_lowbit.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_QL_AVX2 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxDirectRows = 32;  // above this many activation rows: dequantise + at::mm

// An empty asm that "may change" the value: the compiler cannot contract the product before it
// with the sum after it into one FMA (-ffp-contract=fast would, intrinsics included), so the weight
// is rounded twice, as gguf's numpy reference rounds it.
template <typename T>
inline T rounded(T v) {
#if defined(__GNUC__)
  asm("" : "+x"(v));
#endif
  return v;
}

struct QuantView {
  const uint8_t* q;  // row-major int8 [N, K] or packed uint8 [N, K/2] (as bytes)
  const float* scales;
  const float* mins;  // nullptr: no mins
  int64_t N, K, group, bits, zero;
  int64_t groups() const { return K / group; }
  int64_t row_bytes() const { return bits == 8 ? K : K / 2; }
};

// One row of W -> fp32 dst[K]. Same two roundings as the scalar line at the end of each loop.
void dequant_row(const QuantView& w, int64_t n, float* dst) {
  const int64_t G = w.group, ng = w.groups();
  const uint8_t* row = w.q + n * w.row_bytes();
  const float* sc = w.scales + n * ng;
  const float* mn = w.mins ? w.mins + n * ng : nullptr;
  for (int64_t g = 0; g < ng; ++g) {
    const float s = sc[g], m = mn ? mn[g] : 0.0f;
    float* out = dst + g * G;
    if (w.bits == 8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row) + g * G;
      int64_t k = 0;
#ifdef PAGODA_QL_AVX2
      const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
      for (; k + 8 <= G; k += 8) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k))));
        v = rounded(_mm256_mul_ps(vs, v));
        if (mn) v = _mm256_add_ps(v, vm);
        _mm256_storeu_ps(out + k, v);
      }
#endif
      for (; k < G; ++k) {
        const float p = rounded(s * static_cast<float>(q[k]));
        out[k] = mn ? p + m : p;
      }
    } else {
      const int64_t half = G / 2;
      const uint8_t* q = row + g * half;
      int64_t i = 0;
#ifdef PAGODA_QL_AVX2
      const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
      const __m256i vz = _mm256_set1_epi32(static_cast<int>(w.zero)), lo = _mm256_set1_epi32(0x0F);
      for (; i + 8 <= half; i += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
        __m256 a = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, lo), vz));
        __m256 c = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), vz));
        a = rounded(_mm256_mul_ps(vs, a));
        c = rounded(_mm256_mul_ps(vs, c));
        if (mn) {
          a = _mm256_add_ps(a, vm);
          c = _mm256_add_ps(c, vm);
        }
        _mm256_storeu_ps(out + i, a);
        _mm256_storeu_ps(out + half + i, c);
      }
#endif
      for (; i < half; ++i) {
        const float a = rounded(s * static_cast<float>(static_cast<int>(q[i] & 0x0F) - static_cast<int>(w.zero)));
        const float c = rounded(s * static_cast<float>(static_cast<int>(q[i] >> 4) - static_cast<int>(w.zero)));
        out[i] = mn ? a + m : a;
        out[half + i] = mn ? c + m : c;
      }
    }
  }
}

// One row of W as its integer codes minus the zero point, and its scales (the int16 GEMM's input).
void code_row(const QuantView& w, int64_t n, int16_t* dst, float* scales) {
  const int64_t G = w.group, ng = w.groups(), z = w.zero;
  const uint8_t* row = w.q + n * w.row_bytes();
  std::memcpy(scales, w.scales + n * ng, ng * sizeof(float));
  if (w.bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    for (int64_t k = 0; k < w.K; ++k) dst[k] = static_cast<int16_t>(q[k] - z);
    return;
  }
  for (int64_t g = 0; g < ng; ++g) {  // byte i of a group: element i low, element i + G/2 high
    const uint8_t* q = row + g * (G / 2);
    int16_t* o = dst + g * G;
    for (int64_t i = 0; i < G / 2; ++i) {
      o[i] = static_cast<int16_t>((q[i] & 0x0F) - z);
      o[G / 2 + i] = static_cast<int16_t>((q[i] >> 4) - z);
    }
  }
}

inline float dot(const float* a, const float* b, int64_t K) {
  int64_t k = 0;
  float sum = 0.0f;
#ifdef PAGODA_QL_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
  }
  acc0 = _mm256_add_ps(acc0, acc1);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
  s4 = _mm_hadd_ps(s4, s4);
  s4 = _mm_hadd_ps(s4, s4);
  sum = _mm_cvtss_f32(s4);
#endif
#pragma omp simd reduction(+ : sum)
  for (int64_t j = k; j < K; ++j) sum += a[j] * b[j];
  return sum;
}

// Four activation rows against one dequantised weight row: the row is loaded once per k step.
inline void dot4(const float* w, const float* x0, const float* x1, const float* x2, const float* x3,
                 int64_t K, float* r) {
  int64_t k = 0;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#ifdef PAGODA_QL_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    const __m256 vw = _mm256_loadu_ps(w + k);
    a0 = _mm256_fmadd_ps(vw, _mm256_loadu_ps(x0 + k), a0);
    a1 = _mm256_fmadd_ps(vw, _mm256_loadu_ps(x1 + k), a1);
    a2 = _mm256_fmadd_ps(vw, _mm256_loadu_ps(x2 + k), a2);
    a3 = _mm256_fmadd_ps(vw, _mm256_loadu_ps(x3 + k), a3);
  }
  auto hsum = [](__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
  };
  s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
#endif
  for (; k < K; ++k) {
    s0 += w[k] * x0[k];
    s1 += w[k] * x1[k];
    s2 += w[k] * x2[k];
    s3 += w[k] * x3[k];
  }
  r[0] = s0, r[1] = s1, r[2] = s2, r[3] = s3;
}

void direct_buffered(const QuantView& w, const float* x, int64_t M, float* out, const float* bias) {
  const int64_t K = w.K, N = w.N;
  // >= 16 rows per task: enough work to amortise the dispatch, many tasks for the lm_head.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(K);
    float r[4];
    for (int64_t n = begin; n < end; ++n) {
      dequant_row(w, n, buf.data());
      const float b = bias ? bias[n] : 0.0f;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        dot4(buf.data(), x + m * K, x + (m + 1) * K, x + (m + 2) * K, x + (m + 3) * K, K, r);
        for (int64_t j = 0; j < 4; ++j) out[(m + j) * N + n] = r[j] + b;
      }
      for (; m < M; ++m) out[m * N + n] = dot(buf.data(), x + m * K, K) + b;
    }
  });
}

// -- fused decode path: s * sum(q * x) + m * sum(x) per group, weights never stored widened ---------
//
// Per output row and tile of up to MT activation rows: each group's integers are widened in
// registers and multiplied into MT vector accumulators, which are scaled by the group's scale once
// (and its min times the activation row's group sum, computed once per call): ~2 instructions per
// weight and activation row instead of dequantise-store-load-multiply. The weights are the same; the
// sum is reassociated (per group first), within the tests' fp32 bound.
// Compiled for AVX-512 with a target attribute and chosen at run time (__builtin_cpu_supports), so
// the library keeps the portable flags of kernels/cpu_extension.py; AVX2 builds get an 8-wide copy.

#if defined(__GNUC__) && defined(__x86_64__)
#define PAGODA_QL_AVX512 1

template <int MT>
__attribute__((target("avx512f"))) void tile_avx512(const QuantView& w, int64_t n, const float* const* xr,
                                                    const float* const* xsr, float* res) {
  const int64_t G = w.group, ng = w.groups();
  const uint8_t* row = w.q + n * w.row_bytes();
  const float* sc = w.scales + n * ng;
  const float* mn = w.mins ? w.mins + n * ng : nullptr;
  __m512 tot[MT];
  float mins[MT];
  for (int j = 0; j < MT; ++j) tot[j] = _mm512_setzero_ps(), mins[j] = 0.0f;
  const __m512i lo = _mm512_set1_epi32(0x0F), vz = _mm512_set1_epi32(static_cast<int>(w.zero));
  for (int64_t g = 0; g < ng; ++g) {
    __m512 acc[MT];
    for (int j = 0; j < MT; ++j) acc[j] = _mm512_setzero_ps();
    const int64_t base = g * G;
    if (w.bits == 8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row) + base;
      for (int64_t k = 0; k < G; k += 16) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
        for (int j = 0; j < MT; ++j) acc[j] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xr[j] + base + k), acc[j]);
      }
    } else {
      const int64_t half = G / 2;
      const uint8_t* q = row + base / 2;
      for (int64_t i = 0; i < half; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
        const __m512 a = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, lo), vz));
        const __m512 c = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), vz));
        for (int j = 0; j < MT; ++j) {
          acc[j] = _mm512_fmadd_ps(a, _mm512_loadu_ps(xr[j] + base + i), acc[j]);
          acc[j] = _mm512_fmadd_ps(c, _mm512_loadu_ps(xr[j] + base + half + i), acc[j]);
        }
      }
    }
    const __m512 vs = _mm512_set1_ps(sc[g]);
    for (int j = 0; j < MT; ++j) tot[j] = _mm512_fmadd_ps(vs, acc[j], tot[j]);
    if (mn)
      for (int j = 0; j < MT; ++j) mins[j] += mn[g] * xsr[j][g];
  }
  for (int j = 0; j < MT; ++j) res[j] = _mm512_reduce_add_ps(tot[j]) + mins[j];
}

// One activation row (batch-1 decode), four weight rows at a time: each activation vector is loaded
// once for the four, the integers go straight into the products (the zero point joins the mins'
// term, (m - s z) * sum(x), instead of a subtraction per weight), and the per-group work is shared.
template <int BITS>
__attribute__((target("avx512f"))) void rows4_m1_avx512(const QuantView& w, const float* x, const float* xs,
                                                        int64_t n, float* res) {
  const int64_t G = w.group, ng = w.groups(), rb = w.row_bytes();
  const uint8_t* row[4];
  const float* sc[4];
  const float* mn[4];
  for (int r = 0; r < 4; ++r) {
    row[r] = w.q + (n + r) * rb;
    sc[r] = w.scales + (n + r) * ng;
    mn[r] = w.mins ? w.mins + (n + r) * ng : nullptr;
  }
  __m512 tot[4];
  float extra[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int r = 0; r < 4; ++r) tot[r] = _mm512_setzero_ps();
  const __m512i lo = _mm512_set1_epi32(0x0F);
  const float z = static_cast<float>(w.zero);
  for (int64_t g = 0; g < ng; ++g) {
    __m512 acc[4];
    for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t base = g * G;
    if (BITS == 8) {
      for (int64_t k = 0; k < G; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + base + k);
        for (int r = 0; r < 4; ++r) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + base + k));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), xv, acc[r]);
        }
      }
    } else {
      const int64_t half = G / 2;
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 xa = _mm512_loadu_ps(x + base + i), xc = _mm512_loadu_ps(x + base + half + i);
        for (int r = 0; r < 4; ++r) {
          const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + base / 2 + i)));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, lo)), xa, acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), xc, acc[r]);
        }
      }
    }
    for (int r = 0; r < 4; ++r) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r][g]), acc[r], tot[r]);
    if (xs) {
      const float xg = xs[g];
      for (int r = 0; r < 4; ++r) extra[r] += ((mn[r] ? mn[r][g] : 0.0f) - sc[r][g] * z) * xg;
    }
  }
  for (int r = 0; r < 4; ++r) res[r] = _mm512_reduce_add_ps(tot[r]) + extra[r];
}

bool fits_avx512(const QuantView& w) {
  return w.bits == 8 ? w.group % 16 == 0 : w.group % 32 == 0;
}

// PAGODA_CPU_NO_AVX512=1 takes the portable path on an AVX-512 machine (its tests run it so).
bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && std::getenv("PAGODA_CPU_NO_AVX512") == nullptr;
  return yes;
}

// Rows [begin, end) of the output, every activation row, tiles of up to 8.
void rows_avx512(const QuantView& w, const float* x, const float* xs, int64_t M, int64_t begin, int64_t end,
                 float* out, const float* bias) {
  const int64_t K = w.K, N = w.N, ng = w.groups();
  if (M == 1) {
    for (; begin + 4 <= end; begin += 4) {
      float res[4];
      if (w.bits == 8) rows4_m1_avx512<8>(w, x, xs, begin, res);
      else rows4_m1_avx512<4>(w, x, xs, begin, res);
      for (int r = 0; r < 4; ++r) out[begin + r] = res[r] + (bias ? bias[begin + r] : 0.0f);
    }
  }
  for (int64_t n = begin; n < end; ++n) {
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mt = std::min<int64_t>(8, M - m0);
      const float* xr[8];
      const float* xsr[8];
      for (int64_t j = 0; j < mt; ++j) xr[j] = x + (m0 + j) * K, xsr[j] = xs ? xs + (m0 + j) * ng : nullptr;
      float res[8];
      switch (mt) {
        case 1: tile_avx512<1>(w, n, xr, xsr, res); break;
        case 2: tile_avx512<2>(w, n, xr, xsr, res); break;
        case 3: tile_avx512<3>(w, n, xr, xsr, res); break;
        case 4: tile_avx512<4>(w, n, xr, xsr, res); break;
        case 5: tile_avx512<5>(w, n, xr, xsr, res); break;
        case 6: tile_avx512<6>(w, n, xr, xsr, res); break;
        case 7: tile_avx512<7>(w, n, xr, xsr, res); break;
        default: tile_avx512<8>(w, n, xr, xsr, res); break;
      }
      for (int64_t j = 0; j < mt; ++j) out[(m0 + j) * N + n] = res[j] + b;
    }
  }
}
#endif

void direct(const QuantView& w, const float* x, int64_t M, float* out, const float* bias, int64_t act) {
  const int64_t K = w.K, N = w.N;
  // 8-bit codes on a VNNI CPU: activations quantized to int16 or int8, integer dot products
  // (cpu_quant_int8dot.cpp), unless this call asks for fp32 activations (act 32)
  if (w.bits == 8 && pagoda_cpu::int8_dot_linear(x, M, K, reinterpret_cast<const int8_t*>(w.q), w.scales, w.mins,
                                                 N, w.group, bias, out, act))
    return;
  // 4-bit codes in groups of 32: the same with int16 activations, when that is the default and the call
  // does not ask for another precision
  if (w.bits == 4 && (act == 0 || act == 16) &&
      pagoda_cpu::int16_dot_packed(x, M, K, w.q, 4, w.zero, w.scales, w.mins, N, w.group, bias, out))
    return;
#ifdef PAGODA_QL_AVX512
  if (has_avx512() && fits_avx512(w)) {
    std::vector<float> xs;  // per activation row and group: sum of x (the mins' and zero point's term)
    const bool sums = w.mins || (M == 1 && w.zero != 0);
    if (sums) {
      const int64_t ng = w.groups();
      xs.assign(M * ng, 0.0f);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < ng; ++g) {
          float sum = 0.0f;
          for (int64_t k = 0; k < w.group; ++k) sum += x[m * K + g * w.group + k];
          xs[m * ng + g] = sum;
        }
    }
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      rows_avx512(w, x, sums ? xs.data() : nullptr, M, begin, end, out, bias);
    });
    return;
  }
#endif
  direct_buffered(w, x, M, out, bias);
}

// Row-interleaved 8-bit codes (cpu_quant_int8dot.h: q [N/16, K/2, 32], scales [N/16, K/32, 16]):
// the int16 kernel reads them as stored; every other call (prefill rows, another `act`, a CPU
// without AVX512-VNNI) widens rows from the interleaved places into the blocked GEMM's scratch.
at::Tensor quant_linear_interleaved(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                                    int64_t group, int64_t bits, int64_t act) {
  TORCH_CHECK(bits == 8 && group == 32 && !(mins.has_value() && mins->defined()),
              "pagoda_cpu.quant_linear: row-interleaved weights are 8-bit codes in groups of 32 without mins");
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16");
  const int64_t M = x_in.size(0), K = x_in.size(1), G = qweight.size(0), N = 16 * G, nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && qweight.scalar_type() == at::kChar && qweight.is_contiguous() &&
                  qweight.size(1) == K / 2 && qweight.size(2) == 32,
              "row-interleaved qweight must be contiguous int8 [N/16, K/2, 32] for K = ", K);
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == G && scales.size(1) == nb && scales.size(2) == 16,
              "row-interleaved scales must be contiguous fp32 or fp16 [N/16, K/32, 16]");
  const at::Tensor b = pagoda_cpu::fp32_bias(bias, N);
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const bool half = scales.scalar_type() == at::kHalf;
  const int8_t* q = static_cast<const int8_t*>(qweight.const_data_ptr());
  if (M > kMaxDirectRows && pagoda_cpu::int16_gemm_applies(act, K, 32)) {  // prefill: the int16 GEMM
    const at::Tensor sf = scales.to(at::kFloat);
    const float* s = sf.const_data_ptr<float>();
    pagoda_cpu::int16_gemm(x.const_data_ptr<float>(), M, K, N, 32, [&](int64_t n, int16_t* dst, float* sc) {
      const int8_t* qg = q + (n / 16) * 16 * K + 2 * (n % 16);  // as the widening below
      const float* sg = s + (n / 16) * nb * 16 + n % 16;
      for (int64_t k = 0; k < K; k += 2) dst[k] = qg[16 * k], dst[k + 1] = qg[16 * k + 1];
      for (int64_t b = 0; b < nb; ++b) sc[b] = sg[b * 16];
    }, nullptr, bp, out.data_ptr<float>());
  } else if (M > kMaxDirectRows ||
      !pagoda_cpu::int16_dot_linear_interleaved(act, x.const_data_ptr<float>(), M, K, q,
                                                half ? nullptr : scales.const_data_ptr<float>(),
                                                half ? reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>()) : nullptr,
                                                N, bp, out.data_ptr<float>())) {
    const at::Tensor sf = scales.to(at::kFloat);
    const float* s = sf.const_data_ptr<float>();
    pagoda_cpu::blocked_quant_matmul(N, K, x, out, bp, [&](int64_t n, float* dst) {
      const int8_t* qg = q + (n / 16) * 16 * K + 2 * (n % 16);  // the row's first pair
      const float* sg = s + (n / 16) * nb * 16 + n % 16;
      for (int64_t k = 0; k < K; k += 2) {
        const float sc = sg[(k / 32) * 16];
        dst[k] = sc * static_cast<float>(qg[16 * k]);  // pair k/2 sits 32 bytes after pair k/2 - 1
        dst[k + 1] = sc * static_cast<float>(qg[16 * k + 1]);
      }
    });
  }
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

}  // namespace

// Exported (cpu_quant_linear.h): the fused decode stack (kernels/decode/) calls it directly.
namespace pagoda_cpu {

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                        int64_t group, int64_t bits, int64_t zero, int64_t act) {
  TORCH_CHECK(act == 0 || act == 8 || act == 16 || act == 32, "pagoda_cpu.quant_linear: act must be 0, 8, 16 or 32, got ", act);
  if (qweight.dim() == 3) return quant_linear_interleaved(x_in, qweight, scales, mins, bias, group, bits, act);
  if (bits == 5 || bits == 6) return quant_linear_lowbit(x_in, qweight, scales, mins, bias, group, bits, zero, act);
  TORCH_CHECK(bits == 8 || bits == 4, "pagoda_cpu.quant_linear: bits must be 8, 6, 5 or 4, got ", bits);
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "pagoda_cpu.quant_linear: activations must be float32 or bfloat16, got ", x_in.scalar_type());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight.size(0);
  TORCH_CHECK(group > 0 && K % group == 0, "group ", group, " must divide K ", K);
  TORCH_CHECK(bits == 8 || group % 2 == 0, "int4 groups must be even");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1 &&
                  qweight.size(1) == (bits == 8 ? K : K / 2),
              "qweight must be contiguous [N, K] int8 or [N, K/2] uint8 for K = ", K);
  const bool has_min = mins.has_value() && mins->defined();
  // fp16 scales: 8-bit codes in groups of 32 without mins (GGUF Q8_0's, kept as stored)
  const bool half_scales = scales.scalar_type() == at::kHalf && bits == 8 && group == 32 && !has_min;
  TORCH_CHECK((scales.scalar_type() == at::kFloat || half_scales) && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group,
              "scales must be contiguous fp32 [N, K/group] (or fp16 for 8-bit codes in groups of 32 without mins)");
  if (has_min)
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "mins must be contiguous fp32 [N, K/group]");
  const at::Tensor b = pagoda_cpu::fp32_bias(bias, N);
  const bool has_bias = b.defined();
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // bf16: widened once (M x K, small)
  at::Tensor out = at::empty({M, N}, x.options());
  if (half_scales) {
    // The integer dot paths read fp16 scales as they are (half the scale bytes of a decode step);
    // every other path (prefill, fp32 activations, no VNNI) reads an fp32 copy made here.
    if (M <= kMaxDirectRows &&
        pagoda_cpu::int8_dot_linear(x.const_data_ptr<float>(), M, K, static_cast<const int8_t*>(qweight.const_data_ptr()),
                                    nullptr, nullptr, N, group, has_bias ? b.const_data_ptr<float>() : nullptr,
                                    out.data_ptr<float>(), act,
                                    reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>())))
      return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
    return quant_linear(x_in, qweight, scales.to(at::kFloat), mins, bias, group, bits, zero, act);
  }
  QuantView w{static_cast<const uint8_t*>(qweight.const_data_ptr()), scales.const_data_ptr<float>(),
              has_min ? mins->const_data_ptr<float>() : nullptr, N, K, group, bits, zero};
  if (M <= kMaxDirectRows) {
    direct(w, x.const_data_ptr<float>(), M, out.data_ptr<float>(), has_bias ? b.const_data_ptr<float>() : nullptr, act);
  } else if (pagoda_cpu::int16_gemm_applies(act, K, group)) {  // prefill on AVX512-VNNI: the int16 GEMM
    pagoda_cpu::int16_gemm(x.const_data_ptr<float>(), M, K, N, group,
                           [&w](int64_t n, int16_t* dst, float* sc) { code_row(w, n, dst, sc); }, w.mins,
                           has_bias ? b.const_data_ptr<float>() : nullptr, out.data_ptr<float>());
  } else {
    pagoda_cpu::blocked_quant_matmul(w.N, w.K, x, out, has_bias ? b.const_data_ptr<float>() : nullptr,
                                     [&w](int64_t n, float* dst) { dequant_row(w, n, dst); });
  }
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

}  // namespace pagoda_cpu

namespace {

// The weights themselves, dequantised (tests, and the embedding gather of a tied lm_head).
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                            int64_t K, int64_t group, int64_t bits, int64_t zero) {
  if (bits == 5 || bits == 6) return pagoda_cpu::quant_dequantize_lowbit(qweight, scales, mins, K, group, bits, zero);
  if (scales.scalar_type() == at::kHalf)  // Q8_0's scales as stored: widened exactly
    return quant_dequantize(qweight, scales.to(at::kFloat), mins, K, group, bits, zero);
  const int64_t N = qweight.size(0);
  const bool has_min = mins.has_value() && mins->defined();
  QuantView w{static_cast<const uint8_t*>(qweight.const_data_ptr()), scales.const_data_ptr<float>(),
              has_min ? mins->const_data_ptr<float>() : nullptr, N, K, group, bits, zero};
  at::Tensor out = at::empty({N, K}, scales.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) dequant_row(w, n, o + n * K);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int group, int bits, "
        "int zero, int act=0) -> Tensor");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, int K, int group, int bits, int zero) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("quant_linear", &pagoda_cpu::quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
