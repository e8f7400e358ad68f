// Prefill rows of the quantized linear as an int16 GEMM on AVX512-VNNI (cpu_quant_gemm16.h).
//
// Why (issue 47, item 3): a prompt's linears ran as "widen blocks of weight rows to fp32, then
// at::mm" (cpu_quant_blocked.h): an fp32 GEMM, 16 multiply-adds per instruction. vpdpwssd does 32
// (int16 pairs into int32), and the weight codes are small integers already; the activations are
// quantized per 32 to int16 exactly as the decode rows' default path rounds them
// (cpu_quant_int16dot.cpp: max|x| / 65534 per element), so a prompt's tokens and a decoded
// token see the same precision, far inside what moved greedy tokens (int8 activations).
//
// Shape: output columns in panels of 32 (two vectors); per panel the 32 weight rows' codes are
// packed once per call as int16 pairs, [K/2][32][2], so one load gives 16 columns x 2 codes, and
// each activation row's pair (x_k, x_k+1) is one 32-bit broadcast. Tiles of 4 activation rows x
// 32 columns hold 8 int32 and 8 fp32 accumulators; after each block of U = 32 (16 for group 16)
// columns of K the int32 sums are converted and FMA'd into fp32 with scale(n, g) * d(m, b), and
// after each group its min times the row's group sum of x_q * d (as the decode path). Bounds: a
// lane sums U products |code x_q| <= 128 * 32767, < 2^27: exact in int32.

#include "cpu_quant_gemm16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_quant_int8dot.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define PAGODA_G16_X86 1
#define PAGODA_G16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif

namespace pagoda_cpu {

bool int16_gemm_applies(int64_t act, int64_t K, int64_t group) {
#ifdef PAGODA_G16_X86
  static const bool off = [] {  // PAGODA_INT16_GEMM=0: prefill rows widen weights to fp32 (the old path)
    const char* env = std::getenv("PAGODA_INT16_GEMM");
    return env != nullptr && std::string(env) == "0";
  }();
  if (act == kActDefault) act = act_default();
  return !off && int8_dot_mode() == kInt8DotAvx512Vnni && act != kActFp32 && K % 32 == 0 &&
         (group == 16 || group % 32 == 0);
#else
  (void)act, (void)K, (void)group;
  return false;
#endif
}

}  // namespace pagoda_cpu

#ifdef PAGODA_G16_X86
namespace {

constexpr int64_t kPanel = 32;  // output columns per panel (two 16-lane vectors)
constexpr int kTile = 4;        // activation rows per tile

struct XRows {
  const int32_t* xp;  // [M, K/2] int16 pairs of x_q
  const float* d;     // [M, K/32]
  const float* gsum;  // [M, ng] or nullptr
  int64_t K, nb, ng;
};

// Row m of x: per block of 32, d = max|x| / 32767, x_q = round_half_even(x * (1 / d)) in
// [-32767, 32767] (the decode path's rounding, cpu_quant_int16dot.cpp quantize_row512); the
// group sums of x_q * d where there are mins.
PAGODA_G16_TARGET void quantize_row(const float* x, int64_t nb, int64_t group, int16_t* s, float* d, float* gsum) {
  const __m512i hi = _mm512_set1_epi32(32767), lo = _mm512_set1_epi32(-32767);
  for (int64_t b = 0; b < nb; ++b, x += 32, s += 32) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    d[b] = amax / 32767.0f;
    const __m512 id = _mm512_set1_ps(d[b] != 0.0f ? 1.0f / d[b] : 0.0f);
    const __m512i q0 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(v0, id))));
    const __m512i q1 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(v1, id))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s), _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + 16), _mm512_cvtepi32_epi16(q1));
    if (gsum != nullptr) {  // per half block (group 16) or whole block, into its group
      const float h0 = static_cast<float>(_mm512_reduce_add_epi32(q0)) * d[b];
      const float h1 = static_cast<float>(_mm512_reduce_add_epi32(q1)) * d[b];
      if (group == 16) gsum[2 * b] = h0, gsum[2 * b + 1] = h1;
      else gsum[b * 32 / group] += h0 + h1;
    }
  }
}

// A tile of MT activation rows from m0 against one packed panel: out rows m0.., columns n0..n0+cols.
template <int MT, int U, bool MINS>
PAGODA_G16_TARGET void tile(const XRows& a, int64_t group, const int32_t* wp, const float* sp, const float* mp,
                            int64_t m0, float* out, int64_t ldo, int64_t cols, const float* bias) {
  __m512 f[MT][2];
  for (int i = 0; i < MT; ++i) f[i][0] = f[i][1] = _mm512_setzero_ps();
  const int64_t kp_per_u = U / 2, units = a.K / U;
  const int32_t* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.xp + (m0 + i) * (a.K / 2);
  for (int64_t u = 0; u < units; ++u) {
    __m512i acc[MT][2];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    const int32_t* w = wp + u * kp_per_u * kPanel;
    const int64_t kp0 = u * kp_per_u;
    for (int64_t kp = 0; kp < kp_per_u; ++kp, w += kPanel) {
      const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 16);
      for (int i = 0; i < MT; ++i) {
        const __m512i xb = _mm512_set1_epi32(xr[i][kp0 + kp]);
        acc[i][0] = _mm512_dpwssd_epi32(acc[i][0], xb, w0);
        acc[i][1] = _mm512_dpwssd_epi32(acc[i][1], xb, w1);
      }
    }
    const int64_t g = u * U / group, b = u * U / 32;
    const __m512 s0 = _mm512_loadu_ps(sp + g * kPanel), s1 = _mm512_loadu_ps(sp + g * kPanel + 16);
    for (int i = 0; i < MT; ++i) {
      const __m512 dv = _mm512_set1_ps(a.d[(m0 + i) * a.nb + b]);
      f[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][0]), _mm512_mul_ps(s0, dv), f[i][0]);
      f[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1]), _mm512_mul_ps(s1, dv), f[i][1]);
    }
    if (MINS && ((u + 1) * U) % group == 0) {
      const __m512 n0 = _mm512_loadu_ps(mp + g * kPanel), n1 = _mm512_loadu_ps(mp + g * kPanel + 16);
      for (int i = 0; i < MT; ++i) {
        const __m512 gs = _mm512_set1_ps(a.gsum[(m0 + i) * a.ng + g]);
        f[i][0] = _mm512_fmadd_ps(n0, gs, f[i][0]);
        f[i][1] = _mm512_fmadd_ps(n1, gs, f[i][1]);
      }
    }
  }
  const __mmask16 k0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 k1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + 16) : _mm512_setzero_ps();
  for (int i = 0; i < MT; ++i) {  // the bias after the product, as every other path adds it
    _mm512_mask_storeu_ps(out + (m0 + i) * ldo, k0, _mm512_add_ps(f[i][0], b0));
    _mm512_mask_storeu_ps(out + (m0 + i) * ldo + 16, k1, _mm512_add_ps(f[i][1], b1));
  }
}

template <int U, bool MINS>
void panel_rows(const XRows& a, int64_t M, int64_t group, const int32_t* wp, const float* sp, const float* mp,
                float* out, int64_t ldo, int64_t cols, const float* bias) {
  int64_t m0 = 0;
  for (; m0 + kTile <= M; m0 += kTile) tile<kTile, U, MINS>(a, group, wp, sp, mp, m0, out, ldo, cols, bias);
  switch (M - m0) {
    case 3: tile<3, U, MINS>(a, group, wp, sp, mp, m0, out, ldo, cols, bias); break;
    case 2: tile<2, U, MINS>(a, group, wp, sp, mp, m0, out, ldo, cols, bias); break;
    case 1: tile<1, U, MINS>(a, group, wp, sp, mp, m0, out, ldo, cols, bias); break;
    default: break;
  }
}

}  // namespace
#endif

namespace pagoda_cpu {

void int16_gemm(const float* x, int64_t M, int64_t K, int64_t N, int64_t group, const CodeRow& row,
                const float* mins, const float* bias, float* out) {
#ifdef PAGODA_G16_X86
  const int64_t nb = K / 32, ng = K / group;
  std::vector<int16_t> xq(M * K);
  std::vector<float> d(M * nb), gsum(mins ? M * ng : 0, 0.0f);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row(x + m * K, nb, group, xq.data() + m * K, d.data() + m * nb, mins ? gsum.data() + m * ng : nullptr);
  });
  const XRows a{reinterpret_cast<const int32_t*>(xq.data()), d.data(), mins ? gsum.data() : nullptr, K, nb, ng};
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<int16_t> codes(kPanel * K);
    std::vector<float> srow(kPanel * ng), sp(ng * kPanel), mp(mins ? ng * kPanel : 0);
    std::vector<int32_t> wp(K / 2 * kPanel);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      std::fill(codes.begin(), codes.end(), 0);
      std::fill(srow.begin(), srow.end(), 0.0f);
      std::fill(mp.begin(), mp.end(), 0.0f);
      for (int64_t j = 0; j < cols; ++j) row(n0 + j, codes.data() + j * K, srow.data() + j * ng);
      for (int64_t j = 0; j < kPanel; ++j) {  // [K/2][32] pairs; [ng][32] scales and mins
        const int32_t* c = reinterpret_cast<const int32_t*>(codes.data() + j * K);
        for (int64_t kp = 0; kp < K / 2; ++kp) wp[kp * kPanel + j] = c[kp];
        for (int64_t g = 0; g < ng; ++g) sp[g * kPanel + j] = srow[j * ng + g];
        if (mins && j < cols)
          for (int64_t g = 0; g < ng; ++g) mp[g * kPanel + j] = mins[(n0 + j) * ng + g];
      }
      const float* bp = bias ? bias + n0 : nullptr;
      float* o = out + n0;
      if (group == 16) {
        if (mins) panel_rows<16, true>(a, M, group, wp.data(), sp.data(), mp.data(), o, N, cols, bp);
        else panel_rows<16, false>(a, M, group, wp.data(), sp.data(), nullptr, o, N, cols, bp);
      } else {
        if (mins) panel_rows<32, true>(a, M, group, wp.data(), sp.data(), mp.data(), o, N, cols, bp);
        else panel_rows<32, false>(a, M, group, wp.data(), sp.data(), nullptr, o, N, cols, bp);
      }
    }
  });
#else
  (void)x, (void)M, (void)K, (void)N, (void)group, (void)row, (void)mins, (void)bias, (void)out;
#endif
}

}  // namespace pagoda_cpu
