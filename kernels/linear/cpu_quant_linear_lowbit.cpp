// Weight-only linear over packed 5- and 6-bit codes (GGUF Q5_0 / Q5_1 / Q5_K and Q6_K as stored):
// pagoda_cpu::quant_linear (cpu_quant_linear.cpp) hands bits 5 and 6 here.
//
// Why a storage of its own: held as one int8 per code these formats took 1.6x (Q5) / 1.33x (Q6_K)
// the file's bytes, and Q4_K_M is mostly Q5_0 (docs/quantization.md, "Memory"). Packed, they take
// the file's bits per code, and a decode step reads fewer bytes too.
//
//   qweight: uint8 [N, K/32 * (16 + 4 * (bits - 4))], row-major, in blocks of 32 codes:
//            16 bytes of low nibbles (byte i: element i low, element i + 16 high), then the top
//            bits little-endian: bits 5: 4 bytes, element j's fifth bit at bit j;
//                                bits 6: 8 bytes, element j's two top bits at bits 2j, 2j + 1.
//   scales:  fp32 [N, K/group] (group 16 or a multiple of 16);  mins: fp32 [N, K/group] or undefined
//   w[n, k] = scales[n, g] * float(q[n, k] - zero) (+ mins[n, g]),  g = k / group
//
// Two roundings per weight (product, then sum), as gguf's numpy reference: bit-identical weights.
//
// Small M (decode): rows of W are split over torch's threads. On AVX-512 (chosen at run time) each
// block is widened in registers (one broadcast + variable shift puts every lane's top bits in
// place) and multiplied straight into up to 8 activation rows' accumulators, scaled once per group;
// elsewhere (AVX2 or scalar builds) each row is dequantised into an L1 buffer and dotted with the
// activation rows. Large M (prefill): blocks of rows are dequantised and multiplied by at::mm.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include "cpu_quant_blocked.h"
#include "cpu_quant_gemm16.h"
#include "cpu_quant_int8dot.h"
#include "cpu_quant_linear_lowbit.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_LB_AVX2 1
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define PAGODA_LB_AVX512 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;          // codes per packed block
constexpr int64_t kMaxDirectRows = 32;  // as cpu_quant_linear.cpp: above this, dequantise + at::mm

// Keeps the compiler from contracting the product with the following sum into an FMA (see
// cpu_quant_linear.cpp's `rounded`).
template <typename T>
inline T rounded(T v) {
#if defined(__GNUC__)
  asm("" : "+x"(v));
#endif
  return v;
}

struct LowbitView {
  const uint8_t* q;
  const float* scales;
  const float* mins;  // nullptr: no mins
  int64_t N, K, group, bits, zero;
  int64_t block_bytes() const { return 16 + 4 * (bits - 4); }
  int64_t row_bytes() const { return K / kBlock * block_bytes(); }
  int64_t groups() const { return K / group; }
};

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Code j (0..31) of a block, before the zero point.
inline int code(const uint8_t* blk, int64_t bits, int j) {
  const int low = j < 16 ? (blk[j] & 0x0F) : (blk[j - 16] >> 4);
  const int top = bits == 5 ? (blk[16 + (j >> 3)] >> (j & 7)) & 1 : (blk[16 + (j >> 2)] >> (2 * (j & 3))) & 3;
  return low | (top << 4);
}

// One row of W -> fp32 dst[K].
void dequant_row(const LowbitView& w, int64_t n, float* dst) {
  const int64_t G = w.group, ng = w.groups(), bb = w.block_bytes();
  const uint8_t* row = w.q + n * w.row_bytes();
  const float* sc = w.scales + n * ng;
  const float* mn = w.mins ? w.mins + n * ng : nullptr;
  for (int64_t b = 0; b < w.K / kBlock; ++b) {
    const uint8_t* blk = row + b * bb;
    float* out = dst + b * kBlock;
    int j = 0;
#ifdef PAGODA_LB_AVX2
    // 8 codes a step: elements 8c..8c+7 come from nibble bytes 8(c % 2).., low for c < 2, high after
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), nib = _mm256_set1_epi32(0x0F);
    const __m256i vz = _mm256_set1_epi32(static_cast<int>(w.zero));
    for (int c = 0; c < 4; ++c, j += 8) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 8 * (c & 1))));
      const __m256i low = c < 2 ? _mm256_and_si256(bytes, nib) : _mm256_srli_epi32(bytes, 4);
      __m256i top;
      if (w.bits == 5) {
        top = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(load32(blk + 16))),
                                _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c)));
        top = _mm256_and_si256(top, _mm256_set1_epi32(1));
      } else {
        top = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(load32(blk + 16 + 4 * (c >> 1)))),
                                _mm256_slli_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(8 * (c & 1))), 1));
        top = _mm256_and_si256(top, _mm256_set1_epi32(3));
      }
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(top, 4)), vz);
      const int64_t g = (b * kBlock + j) / G;  // 8 codes never straddle a group (G % 16 == 0)
      __m256 v = rounded(_mm256_mul_ps(_mm256_set1_ps(sc[g]), _mm256_cvtepi32_ps(q)));
      if (mn) v = _mm256_add_ps(v, _mm256_set1_ps(mn[g]));
      _mm256_storeu_ps(out + j, v);
    }
#endif
    for (; j < kBlock; ++j) {
      const int64_t g = (b * kBlock + j) / G;
      const float p = rounded(sc[g] * static_cast<float>(code(blk, w.bits, j) - static_cast<int>(w.zero)));
      out[j] = mn ? p + mn[g] : p;
    }
  }
}

inline float dot(const float* a, const float* b, int64_t K) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < K; ++k) sum += a[k] * b[k];
  return sum;
}

void direct_buffered(const LowbitView& w, const float* x, int64_t M, float* out, const float* bias) {
  const int64_t K = w.K, N = w.N;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(K);
    for (int64_t n = begin; n < end; ++n) {
      dequant_row(w, n, buf.data());
      const float b = bias ? bias[n] : 0.0f;
      for (int64_t m = 0; m < M; ++m) out[m * N + n] = dot(buf.data(), x + m * K, K) + b;
    }
  });
}

#ifdef PAGODA_LB_AVX512

// A block's 32 codes minus the zero point: a = elements 0..15, c = elements 16..31.
template <int BITS>
__attribute__((target("avx512f"))) inline void unpack_block(const uint8_t* blk, __m512i vz, __m512i& a, __m512i& c) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  __m512i ta, tc;
  if (BITS == 5) {
    const __m512i plane = _mm512_set1_epi32(static_cast<int>(load32(blk + 16)));
    const __m512i one = _mm512_set1_epi32(1);
    ta = _mm512_and_si512(_mm512_srlv_epi32(plane, lane), one);
    tc = _mm512_and_si512(_mm512_srlv_epi32(plane, _mm512_add_epi32(lane, _mm512_set1_epi32(16))), one);
  } else {
    const __m512i three = _mm512_set1_epi32(3), shift = _mm512_slli_epi32(lane, 1);
    ta = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(load32(blk + 16))), shift), three);
    tc = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(load32(blk + 20))), shift), three);
  }
  const __m512i nib = _mm512_set1_epi32(0x0F);
  a = _mm512_sub_epi32(_mm512_or_si512(_mm512_and_si512(bytes, nib), _mm512_slli_epi32(ta, 4)), vz);
  c = _mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32(bytes, 4), _mm512_slli_epi32(tc, 4)), vz);
}

// One output row against MT activation rows: s * sum((q - z) * x) per group, + m * sum(x).
template <int BITS, int MT>
__attribute__((target("avx512f"))) void tile(const LowbitView& w, int64_t n, const float* const* xr,
                                             const float* const* xsr, float* res) {
  const int64_t G = w.group, ng = w.groups(), bb = w.block_bytes(), nb = w.K / kBlock;
  const uint8_t* row = w.q + n * w.row_bytes();
  const float* sc = w.scales + n * ng;
  const float* mn = w.mins ? w.mins + n * ng : nullptr;
  const __m512i vz = _mm512_set1_epi32(static_cast<int>(w.zero));
  __m512 tot[MT], acc[MT];
  for (int j = 0; j < MT; ++j) tot[j] = acc[j] = _mm512_setzero_ps();
  int64_t cur = 0;  // the group acc belongs to (no lambda: it would not inherit the target attribute)
  for (int64_t b = 0; b < nb; ++b) {
    __m512i a, c;
    unpack_block<BITS>(row + b * bb, vz, a, c);
    for (int h = 0; h < 2; ++h) {
      const int64_t e = b * kBlock + 16 * h, g = e / G;
      if (g != cur) {  // a group ends: scale its sum once
        const __m512 s = _mm512_set1_ps(sc[cur]);
        for (int j = 0; j < MT; ++j) tot[j] = _mm512_fmadd_ps(s, acc[j], tot[j]), acc[j] = _mm512_setzero_ps();
        cur = g;
      }
      const __m512 v = _mm512_cvtepi32_ps(h ? c : a);
      for (int j = 0; j < MT; ++j) acc[j] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xr[j] + e), acc[j]);
    }
  }
  const __m512 s = _mm512_set1_ps(sc[cur]);
  for (int j = 0; j < MT; ++j) tot[j] = _mm512_fmadd_ps(s, acc[j], tot[j]);
  for (int j = 0; j < MT; ++j) {
    float extra = 0.0f;
    if (mn)
      for (int64_t g = 0; g < ng; ++g) extra += mn[g] * xsr[j][g];
    res[j] = _mm512_reduce_add_ps(tot[j]) + extra;
  }
}

template <int BITS>
void rows_avx512(const LowbitView& w, const float* x, const float* xs, int64_t M, int64_t begin, int64_t end,
                 float* out, const float* bias) {
  const int64_t K = w.K, N = w.N, ng = w.groups();
  for (int64_t n = begin; n < end; ++n) {
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mt = std::min<int64_t>(8, M - m0);
      const float* xr[8];
      const float* xsr[8];
      for (int64_t j = 0; j < mt; ++j) xr[j] = x + (m0 + j) * K, xsr[j] = xs ? xs + (m0 + j) * ng : nullptr;
      float res[8];
      switch (mt) {
        case 1: tile<BITS, 1>(w, n, xr, xsr, res); break;
        case 2: tile<BITS, 2>(w, n, xr, xsr, res); break;
        case 3: tile<BITS, 3>(w, n, xr, xsr, res); break;
        case 4: tile<BITS, 4>(w, n, xr, xsr, res); break;
        case 5: tile<BITS, 5>(w, n, xr, xsr, res); break;
        case 6: tile<BITS, 6>(w, n, xr, xsr, res); break;
        case 7: tile<BITS, 7>(w, n, xr, xsr, res); break;
        default: tile<BITS, 8>(w, n, xr, xsr, res); break;
      }
      for (int64_t j = 0; j < mt; ++j) out[(m0 + j) * N + n] = res[j] + b;
    }
  }
}

// PAGODA_CPU_NO_AVX512=1 takes the portable path on an AVX-512 machine (the tests run it so).
bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && std::getenv("PAGODA_CPU_NO_AVX512") == nullptr;
  return yes;
}
#endif

void direct(const LowbitView& w, const float* x, int64_t M, float* out, const float* bias) {
  // An AVX512-VNNI CPU with int16 activations by default (cpu_quant_int8dot.h): integer dot products
  if (pagoda_cpu::int16_dot_packed(x, M, w.K, w.q, w.bits, w.zero, w.scales, w.mins, w.N, w.group, bias, out)) return;
#ifdef PAGODA_LB_AVX512
  if (has_avx512()) {
    std::vector<float> xs;  // per activation row and group: sum of x (the mins' term)
    if (w.mins) {
      const int64_t ng = w.groups();
      xs.assign(M * ng, 0.0f);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < w.K; ++k) xs[m * ng + k / w.group] += x[m * w.K + k];
    }
    const float* xsp = w.mins ? xs.data() : nullptr;
    at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) {
      if (w.bits == 5) rows_avx512<5>(w, x, xsp, M, begin, end, out, bias);
      else rows_avx512<6>(w, x, xsp, M, begin, end, out, bias);
    });
    return;
  }
#endif
  direct_buffered(w, x, M, out, bias);
}

LowbitView view(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                int64_t K, int64_t group, int64_t bits, int64_t zero) {
  TORCH_CHECK(bits == 5 || bits == 6, "pagoda_cpu: low-bit storage is 5 or 6 bits, got ", bits);
  TORCH_CHECK(K % kBlock == 0 && group > 0 && group % 16 == 0 && K % group == 0,
              "5/6-bit storage needs K (", K, ") a multiple of 32 and group (", group, ") a multiple of 16 dividing it");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1 &&
                  qweight.size(1) == K / kBlock * (16 + 4 * (bits - 4)),
              "qweight must be contiguous uint8 [N, K * bits / 8] for K = ", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group, "scales must be contiguous fp32 [N, K/group]");
  const bool has_min = mins.has_value() && mins->defined();
  if (has_min)
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "mins must be contiguous fp32 [N, K/group]");
  return LowbitView{static_cast<const uint8_t*>(qweight.const_data_ptr()), scales.const_data_ptr<float>(),
                    has_min ? mins->const_data_ptr<float>() : nullptr, N, K, group, bits, zero};
}

}  // namespace

namespace pagoda_cpu {

at::Tensor quant_linear_lowbit(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                               int64_t group, int64_t bits, int64_t zero, int64_t act) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "pagoda_cpu.quant_linear: activations must be float32 or bfloat16, got ", x_in.scalar_type());
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const LowbitView w = view(qweight, scales, mins, K, group, bits, zero);
  const at::Tensor b = pagoda_cpu::fp32_bias(bias, w.N);
  const bool has_bias = b.defined();
  const float* bp = has_bias ? b.const_data_ptr<float>() : nullptr;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // bf16: widened once (M x K, small)
  at::Tensor out = at::empty({M, w.N}, x.options());
  if (M <= kMaxDirectRows) direct(w, x.const_data_ptr<float>(), M, out.data_ptr<float>(), bp);
  else if (pagoda_cpu::int16_gemm_applies(act, K, group))  // prefill on AVX512-VNNI (cpu_quant_gemm16.h)
    pagoda_cpu::int16_gemm(x.const_data_ptr<float>(), M, K, w.N, group, [&w](int64_t n, int16_t* dst, float* sc) {
      const int64_t ng = w.groups(), bb = w.block_bytes();
      const uint8_t* row = w.q + n * w.row_bytes();
      std::memcpy(sc, w.scales + n * ng, ng * sizeof(float));
      for (int64_t k = 0; k < w.K; ++k)
        dst[k] = static_cast<int16_t>(code(row + (k / kBlock) * bb, w.bits, static_cast<int>(k % kBlock)) - w.zero);
    }, w.mins, bp, out.data_ptr<float>());
  else pagoda_cpu::blocked_quant_matmul(w.N, w.K, x, out, bp, [&w](int64_t n, float* dst) { dequant_row(w, n, dst); });
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

at::Tensor quant_dequantize_lowbit(const at::Tensor& qweight, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& mins, int64_t K, int64_t group, int64_t bits,
                                   int64_t zero) {
  const LowbitView w = view(qweight, scales, mins, K, group, bits, zero);
  at::Tensor out = at::empty({w.N, K}, scales.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) dequant_row(w, n, o + n * K);
  });
  return out;
}

}  // namespace pagoda_cpu
