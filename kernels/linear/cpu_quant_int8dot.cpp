// Int8 dot products for the quantized linear's decode rows (cpu_quant_linear.cpp calls it for
// M <= 32): 8-bit weight codes (Q8_0, Q5_0/Q5_1/Q5_K as int8, Q6_K, --quantization int8) times
// activations quantized to int8 per 32 elements, as llama.cpp multiplies Q8_0 by Q8_0.
//
// Why: the fp32 path widens every int8 code to fp32 and FMAs it (int8 -> int32 -> fp32 -> FMA:
// 3 instructions per 16 weights and activation row); VNNI's vpdpbusd multiplies 64 u8 x s8 pairs
// into 16 int32 sums in one. At batch 1 SmolLM2's 49,152-row tied lm_head alone took 5-9 ms a step.
//
// Activations: per row and block of 32, d = max|x| / 127, x_q = round_half_even(x / d) in [-127, 127].
// vpdpbusd's first operand is unsigned, so the weight codes go in as u8 q + 128 (q ^ 0x80, one
// instruction) and the accumulator starts at -128 * sum(x_q) of the lane's 4 activations,
// computed once per call: each lane ends at exactly sum(q x_q) with one vpdpbusd per 64 weights.
// It is exact in int32 (|sum| <= 32 * 128 * 127) and in its fp32 conversion (< 2^24); then
// out += (s_w(g) * d) * sum per block, in fp32.
// Mins (Q5_1, Q5_K): mins * sum of the quantized x over the group, per group. 8-bit codes carry no
// zero point (QuantizedWeight.unpacked: it is already subtracted in storage).
//
// Compiled with target attributes (not -mavx512vnni) and chosen at run time, so one library serves
// every x86-64 CPU: AVX512-VNNI (Intel Cascade Lake+, AMD Zen 4), else AVX-VNNI (Alder Lake+),
// else the fp32 path. PAGODA_CPU_NO_AVX512=1 (the portable-path switch of cpu_quant_linear.cpp)
// leaves only AVX-VNNI.
//
// Which activations, per call (the op's `act`): int16 by default (cpu_quant_int16dot.cpp: SmolLM2's
// greedy tokens match HF's on the same Q8_0 weights 100%, int8 activations 79%), int8 here
// (act 8: llama.cpp's rounding, ~1.1x faster on the whole batch-1 step), or the fp32 path (act 32).
// PAGODA_INT8_DOT=0|8|16 sets the process default (0: the fp32 path everywhere).

#include "cpu_quant_int8dot.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define PAGODA_I8_X86 1
#endif

namespace {

constexpr int64_t kBlock = 32;  // activation quantization block (Q8_0's)
constexpr int64_t kChunk = 64;  // bytes per 512-bit vector: two blocks

// Activation rows, quantized once per call; K padded to whole 64-byte chunks with zeros.
struct QuantAct {
  int64_t M = 0, K = 0, Kp = 0, chunks = 0, ng = 0;
  std::vector<int8_t> s;     // [M, Kp] x_q
  std::vector<int32_t> neg;  // [M, chunks, 16]: -128 * (sum of the lane's 4 x_q): vpdpbusd's start
  std::vector<float> d;      // [M, K/32] the blocks' scales
  std::vector<float> dv;     // [M, chunks, 16]: lanes 0-7 the scale of block 2c, lanes 8-15 of 2c + 1
  std::vector<float> gsum;   // [M, ng] sum of q * d over each weight group (mins only)
  std::vector<int32_t> g0, g1;  // [chunks]: the weight groups of blocks 2c and 2c + 1 (group >= 32)
};

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t group, bool sums, QuantAct& a) {
  a.M = M, a.K = K, a.chunks = (K + kChunk - 1) / kChunk, a.Kp = a.chunks * kChunk, a.ng = K / group;
  a.s.assign(M * a.Kp, 0);
  a.neg.assign(M * a.chunks * 16, 0);
  a.d.assign(M * (K / kBlock), 0.0f);
  a.dv.assign(M * a.chunks * 16, 0.0f);
  if (sums) a.gsum.assign(M * a.ng, 0.0f);
  a.g0.resize(a.chunks), a.g1.resize(a.chunks);  // per call, not per row: no division in the loops
  for (int64_t c = 0; c < a.chunks; ++c) {
    a.g0[c] = static_cast<int32_t>(2 * c * kBlock / group);
    a.g1[c] = static_cast<int32_t>(std::min<int64_t>((2 * c + 1) * kBlock / group, a.ng - 1));
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* sr = a.s.data() + m * a.Kp;
    int32_t* neg = a.neg.data() + m * a.chunks * 16;  // lane i of chunk c: elements 4i..4i+3 of it
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const float* xb = xr + b * kBlock;
      float amax = 0.0f;
      for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      for (int64_t k = 0; k < kBlock; ++k) {
        // nearbyint: round half to even (the default mode), as torch.round in the tests' reference
        const int v = static_cast<int>(std::nearbyint(xb[k] * id));
        const int q = std::min(127, std::max(-127, v));
        sr[b * kBlock + k] = static_cast<int8_t>(q);
        neg[(b * kBlock + k) / 4] -= 128 * q;
        if (sums) a.gsum[m * a.ng + (b * kBlock + k) / group] += static_cast<float>(q) * d;
      }
      a.d[m * (K / kBlock) + b] = d;
      float* lanes = a.dv.data() + (m * a.chunks + b / 2) * 16 + (b % 2) * 8;
      for (int i = 0; i < 8; ++i) lanes[i] = d;
    }
  }
}

struct Weights {
  const int8_t* q;
  const float* scales;  // fp32 [N, ng], or nullptr where `half` holds them
  const uint16_t* half;  // fp16 [N, ng] (groups of 32, no mins: Q8_0 as stored), or nullptr
  const float* mins;  // nullptr: none
  int64_t N, K, group, ng;
};

// mins * sum(x_q d) over the groups of row n, activation row m (0 without mins).
inline float group_terms(const Weights& w, const QuantAct& a, int64_t n, int64_t m) {
  if (w.mins == nullptr) return 0.0f;
  const float* mn = w.mins + n * w.ng;
  float extra = 0.0f;
  for (int64_t g = 0; g < w.ng; ++g) extra += mn[g] * a.gsum[m * w.ng + g];
  return extra;
}

#ifdef PAGODA_I8_X86
#define PAGODA_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define PAGODA_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// Weight groups per 64-byte chunk: the scale of each lane (4 weights) is built per chunk, per row.
enum Scales { kAny = 0, kG16 = 1, kG32 = 2 };

// The weight scales of one 64-byte chunk as 16 lanes: group >= 32: lanes 0-7 the group of block
// 2c, 8-15 of 2c + 1; group 16: 4 lanes per group.
template <int SC>
PAGODA_VNNI512 inline __m512 chunk_scales512(const float* sc, const QuantAct& a, int64_t c) {
  if (SC == kG16) {
    const int64_t g0 = 4 * c;
    const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(4, a.ng - g0)) - 1);
    const __m512 four = _mm512_castps128_ps512(_mm_maskz_loadu_ps(live, sc + g0));
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), four);
  }
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sc[a.g0[c]]), _mm512_set1_ps(sc[a.g1[c]]));
}

// R weight rows from n against MT activation rows from m0: res[r * MT + j].
// Per 64 weights and activation row: q ^ 0x80, one vpdpbusd, a conversion and an FMA by the
// block's (weight scale * activation scale), built per chunk (kAny, kG16) or, for groups of 32
// (Q8_0, --quantization int8), multiplied 16 blocks at a time and spread by one permute per chunk.
template <int R, int MT, int SC>
PAGODA_VNNI512 void tile512(const Weights& w, const QuantAct& a, int64_t n, int64_t m0, float* res) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t tail = w.K - (a.chunks - 1) * kChunk;  // 32 or 64 bytes in the last chunk
  const int64_t nb = w.K / kBlock;
  for (int64_t c0 = 0; c0 < a.chunks; c0 += 8) {  // windows of 8 chunks = 16 blocks
    __m512 prod[R][MT];  // kG32: s_w(b) * d_x(b) for the window's 16 blocks
    if (SC == kG32) {
      const __mmask16 blocks = static_cast<__mmask16>((1u << std::min<int64_t>(16, nb - 2 * c0)) - 1);
      for (int j = 0; j < MT; ++j) {
        const __m512 dx = _mm512_maskz_loadu_ps(blocks, a.d.data() + (m0 + j) * nb + 2 * c0);
        for (int r = 0; r < R; ++r)
          prod[r][j] = _mm512_mul_ps(
              w.half != nullptr ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(blocks, w.half + (n + r) * w.ng + 2 * c0))
                                : _mm512_maskz_loadu_ps(blocks, w.scales + (n + r) * w.ng + 2 * c0),
              dx);
      }
    }
    for (int64_t c = c0; c < std::min<int64_t>(c0 + 8, a.chunks); ++c) {
      const __mmask64 live = c + 1 < a.chunks || tail == kChunk ? ~__mmask64{0} : (__mmask64{1} << tail) - 1;
      const __m512i idx = _mm512_add_epi32(pair, _mm512_set1_epi32(static_cast<int>(2 * (c - c0))));
      __m512i xs[MT], neg[MT];
      __m512 xd[MT];
      for (int j = 0; j < MT; ++j) {
        xs[j] = _mm512_loadu_si512(a.s.data() + (m0 + j) * a.Kp + c * kChunk);
        neg[j] = _mm512_loadu_si512(a.neg.data() + ((m0 + j) * a.chunks + c) * 16);
        if (SC != kG32) xd[j] = _mm512_loadu_ps(a.dv.data() + ((m0 + j) * a.chunks + c) * 16);
      }
      for (int r = 0; r < R; ++r) {
        // past K (the last chunk's upper half at K % 64 == 32): q = 0, x_q = 0, start 0
        const __m512i qu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, w.q + (n + r) * w.K + c * kChunk), flip);
        __m512 ws;
        if (SC != kG32) ws = chunk_scales512<SC>(w.scales + (n + r) * w.ng, a, c);
        for (int j = 0; j < MT; ++j) {
          const __m512i dot = _mm512_dpbusd_epi32(neg[j], qu, xs[j]);  // sum(q x_q) per 4 weights
          const __m512 scale = SC == kG32 ? _mm512_permutexvar_ps(idx, prod[r][j]) : _mm512_mul_ps(ws, xd[j]);
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) res[r * MT + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// The same with 256-bit AVX-VNNI (no AVX-512): one 32-element block per vector.
template <int R, int MT>
PAGODA_AVXVNNI void tile256(const Weights& w, const QuantAct& a, int64_t n, int64_t m0, float* res) {
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i quads = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);  // group 16: lanes 0-3, 4-7
  for (int64_t b = 0; b < w.K / kBlock; ++b) {
    __m256i xs[MT], neg[MT];
    __m256 xd[MT];
    for (int j = 0; j < MT; ++j) {
      const int64_t lanes = ((m0 + j) * a.chunks + b / 2) * 16 + (b % 2) * 8;  // this block's 8 lanes
      xs[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.s.data() + (m0 + j) * a.Kp + b * kBlock));
      neg[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.neg.data() + lanes));
      xd[j] = _mm256_set1_ps(a.dv[lanes]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i qu = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + (n + r) * w.K + b * kBlock)), flip);
      const float* sc = w.half == nullptr ? w.scales + (n + r) * w.ng : nullptr;  // fp16: groups of 32
      const __m256 ws = w.group == 16
                            ? _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(
                                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 2 * b)))),
                                                       quads)
                            : _mm256_set1_ps(sc != nullptr ? sc[(b & 1) ? a.g1[b >> 1] : a.g0[b >> 1]]
                                                           : _cvtsh_ss(w.half[(n + r) * w.ng + b]));
      for (int j = 0; j < MT; ++j) {
        const __m256i dot = _mm256_dpbusd_avx_epi32(neg[j], qu, xs[j]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, xd[j]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j) {
      const __m256 v = acc[r][j];
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_hadd_ps(s, s);
      s = _mm_hadd_ps(s, s);
      res[r * MT + j] = _mm_cvtss_f32(s);
    }
}

template <int R, int MT>
void tile(int64_t mode, const Weights& w, const QuantAct& a, int64_t n, int64_t m0, float* res) {
  if (mode == pagoda_cpu::kInt8DotAvx512Vnni) {
    if (w.group == 32) tile512<R, MT, kG32>(w, a, n, m0, res);
    else if (w.group == 16) tile512<R, MT, kG16>(w, a, n, m0, res);
    else tile512<R, MT, kAny>(w, a, n, m0, res);
  }
  else tile256<R, MT>(w, a, n, m0, res);
}

// R weight rows from n against every activation row, in tiles of up to 4: the R rows' bytes are
// read from memory once and stay in L1 for the tiles after the first.
template <int R, int MT>
void emit(int64_t mode, const Weights& w, const QuantAct& a, int64_t n, int64_t m0, const float* bias, float* out) {
  float res[R * MT];
  tile<R, MT>(mode, w, a, n, m0, res);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MT; ++j)
      out[(m0 + j) * w.N + n + r] = res[r * MT + j] + group_terms(w, a, n + r, m0 + j) + (bias ? bias[n + r] : 0.0f);
}

template <int R>
void block(int64_t mode, const Weights& w, const QuantAct& a, int64_t n, const float* bias, float* out) {
  pagoda_cpu::for_row_tiles(a.M, [&](auto mt, int64_t m0) { emit<R, decltype(mt)::value>(mode, w, a, n, m0, bias, out); });
}

// Output rows [begin, end): 4 weight rows at a time at M = 1 (sharing each activation load), 2
// above (8 accumulators for a tile of 4), then the remainder one at a time.
void rows(int64_t mode, const Weights& w, const QuantAct& a, int64_t begin, int64_t end, const float* bias,
          float* out) {
  int64_t n = begin;
  if (a.M == 1)
    for (; n + 4 <= end; n += 4) block<4>(mode, w, a, n, bias, out);
  else
    for (; n + 2 <= end; n += 2) block<2>(mode, w, a, n, bias, out);
  for (; n < end; ++n) block<1>(mode, w, a, n, bias, out);
}
#endif

int64_t detect() {
#ifdef PAGODA_I8_X86
  __builtin_cpu_init();
  const bool no512 = std::getenv("PAGODA_CPU_NO_AVX512") != nullptr;
  if (!no512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return pagoda_cpu::kInt8DotAvx512Vnni;
  if (__builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return pagoda_cpu::kInt8DotAvxVnni;
#endif
  return pagoda_cpu::kInt8DotOff;
}

// PAGODA_INT8_DOT: "0" the fp32 path for every call, "8" / "16" that activation precision by
// default, unset (or anything else) the measured default below.
int64_t env_act() {
  const char* env = std::getenv("PAGODA_INT8_DOT");
  if (env != nullptr && std::strcmp(env, "0") == 0) return pagoda_cpu::kActFp32;
  if (env != nullptr && std::strcmp(env, "8") == 0) return pagoda_cpu::kActInt8;
  if (env != nullptr && std::strcmp(env, "16") == 0) return pagoda_cpu::kActInt16;
  // int16 activations: SmolLM2's greedy tokens stay on HF's (int8 ones took the match to 81%)
  return pagoda_cpu::kActInt16;
}

std::atomic<int64_t>& act_now() {
  static std::atomic<int64_t> act{env_act()};
  return act;
}

std::atomic<int64_t>& mode_now() {
  static std::atomic<int64_t> mode{env_act() == pagoda_cpu::kActFp32 ? pagoda_cpu::kInt8DotOff
                                                                     : pagoda_cpu::int8_dot_supported()};
  return mode;
}

// [kernel in use, best supported, default activation bits]; enable >= 0 first turns the path off
// (0) or on (else, the supported kernel); act 8 / 16 / 32 first sets the default precision.
std::vector<int64_t> quant_int8_dot(int64_t enable, int64_t act) {
  if (enable >= 0) mode_now().store(enable == 0 ? pagoda_cpu::kInt8DotOff : pagoda_cpu::int8_dot_supported());
  TORCH_CHECK(act < 0 || act == 8 || act == 16 || act == 32, "quant_int8_dot: act must be 8, 16 or 32, got ", act);
  if (act > 0) act_now().store(act);
  return {mode_now().load(), pagoda_cpu::int8_dot_supported(), act_now().load()};
}

}  // namespace

namespace pagoda_cpu {

int64_t int8_dot_supported() {
  static const int64_t best = detect();
  return best;
}

int64_t int8_dot_mode() { return mode_now().load(std::memory_order_relaxed); }

int64_t act_default() { return act_now().load(std::memory_order_relaxed); }

bool int8_dot_linear(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scales, const float* mins,
                     int64_t N, int64_t group, const float* bias, float* out, int64_t act,
                     const uint16_t* half_scales) {
  const int64_t mode = int8_dot_mode();
  if (act == kActDefault) act = act_default();
  if (mode == kInt8DotOff || act == kActFp32 || K % kBlock != 0 || (group % kBlock != 0 && group != 16)) return false;
  if (act == kActInt16) return int16_dot_linear(mode, x, M, K, q, scales, mins, N, group, bias, out, half_scales);
  if (half_scales != nullptr && (group != kBlock || mins != nullptr)) return false;
#ifdef PAGODA_I8_X86
  QuantAct a;
  quantize_rows(x, M, K, group, mins != nullptr, a);
  const Weights w{q, scales, half_scales, mins, N, K, group, K / group};
  // 64 rows per task at least (~37 KB of weights at K = 576); torch splits N evenly over threads.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { rows(mode, w, a, begin, end, bias, out); });
  return true;
#else
  return false;
#endif
}

}  // namespace pagoda_cpu

// No tensor argument, so no dispatch key: a catch-all kernel.
TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) { m.def("quant_int8_dot(int enable=-1, int act=-1) -> int[]", &quant_int8_dot); }
