// The per-work-item attention loop of cpu_attention.cpp: one (sequence, KV head, tile of query
// rows) against the blocks its last row can see, with a flash-style online softmax in fp32.
//
// Written with GCC/Clang vector extensions (8 floats): the compiler lowers them to whatever the
// build targets (AVX2+FMA where the CPU has it, SSE pairs otherwise), and unlike `omp simd`
// reductions they keep accumulators in registers. Shapes: D is padded to Dp (a multiple of 8) with
// zeros wherever rows are copied, so no loop has a scalar tail.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace pagoda_cpu {

using v8 = float __attribute__((vector_size(32)));
using v8i = int32_t __attribute__((vector_size(32)));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }  // unaligned
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 splat(float x) { return v8{} + x; }
inline v8 vmax(v8 a, v8 b) { return a > b ? a : b; }
inline float hmax(v8 v) { float m = v[0]; for (int j = 1; j < 8; ++j) m = std::max(m, v[j]); return m; }
inline float hsum(v8 v) { float s = 0.f; for (int j = 0; j < 8; ++j) s += v[j]; return s; }

// FP8 caches (vLLM's --kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2): all 256 codes decoded once into a
// table, so a cache element costs one load, the same as the bf16 shift. The per-tensor scales are
// folded in by the caller (k_scale into the softmax scale, v_scale into the output).
template <typename F8>
inline const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int code = 0; code < 256; ++code) {
      F8 x;
      x.x = static_cast<uint8_t>(code);
      t[code] = static_cast<float>(x);
    }
    return t;
  }();
  return table.data();
}
inline float to_float(c10::Float8_e4m3fn x) { return fp8_table<c10::Float8_e4m3fn>()[x.x]; }
inline float to_float(c10::Float8_e5m2 x) { return fp8_table<c10::Float8_e5m2>()[x.x]; }

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {  // the top half of an fp32: a shift
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 2^x for x <= 0 (scores minus the running max), all lanes at once: libm's expf is a scalar call
// that would cost as much as the dot products. Degree-7 Taylor of 2^f on |f| <= 1/2: relative
// error < 1e-8, below fp32 rounding. x < -126 (and -inf, a masked lane) gives exactly 0.
inline v8 exp2_nonpos(v8 x) {
  const v8 xc = vmax(x, splat(-126.f));
  const v8 kRound = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const v8 n = (xc + kRound) - kRound;
  const v8 f = xc - n;  // in [-1/2, 1/2]
  v8 p = splat(1.5252733804059841e-5f);  // ln2^7 / 7!
  p = p * f + 1.5403530393381609e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;  // 2^n, n in [-126, 0]
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < splat(-126.f) ? splat(0.f) : p * scale;
}

// Lane j of the result = the horizontal sum of a[j] (eight dot-product partials -> eight dots).
inline v8 hsum8(const v8* a) {
  auto hadd = [](v8 x, v8 y) {  // vhaddps: pairwise sums, per 128-bit half
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8 lo = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  // [s0..s3 low halves | s0..s3 high]
  const v8 hi = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

struct Geometry {
  int64_t group, head_dim, padded_dim, block_size;
  int64_t q_tok, q_head;           // query strides (elements)
  int64_t out_tok;                 // out is contiguous [T, Hq, D]
  int64_t k_block, k_tok, k_head;  // cache strides (elements)
  int64_t v_block, v_tok, v_head;
  int64_t table_stride;
  float scale_log2;                // scale * log2(e): scores in log2 units, softmax in exp2
  int64_t window;                  // sliding window: position p sees (p - window, p]; 0: no window
  float soft_cap_log2;             // logits soft cap * log2(e), in the scores' log2 units; 0: no cap
};

// The first position the query row at `pos` sees.
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

struct Item {
  int64_t seq, head_begin, head_end;   // KV heads [head_begin, head_end)
  int64_t row_begin, row_end, pos_begin;  // query rows; pos of row r: pos_begin + r - row_begin
  int64_t cost;
};

// Per-thread buffers, sized for the largest tile. Block rows are padded to a multiple of 8 with
// pointers to `zeros`, never to cache rows past the block's visible end (they may hold NaN).
struct Scratch {
  std::vector<float> q, acc, m, l, s, k, v, zeros;
  std::vector<const float*> krow;
  Scratch(int64_t vectors, const Geometry& g)
      : q(vectors * g.padded_dim), acc(vectors * g.padded_dim), m(vectors), l(vectors),
        s(pad8(g.block_size)), k(g.block_size * g.padded_dim), v(g.block_size * g.padded_dim),
        zeros(g.padded_dim, 0.f), krow(pad8(g.block_size)) {}
  static int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }
};

// acc[0, 8*NV) += sum_t p[t] * v_t: NV accumulators stay in registers across the tokens.
template <int NV>
inline void pv_chunk(float* acc, const float* v, int64_t vs, const float* p, int64_t n) {
  v8 a[NV];
  for (int j = 0; j < NV; ++j) a[j] = load8(acc + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    const v8 pt = splat(p[t]);
    const float* vr = v + t * vs;
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) a[j] += pt * load8(vr + 8 * j);
  }
  for (int j = 0; j < NV; ++j) store8(acc + 8 * j, a[j]);
}

inline void pv(float* acc, const float* v, int64_t vs, const float* p, int64_t n, int64_t Dp) {
  int64_t c = 0;
  for (; c + 64 <= Dp; c += 64) pv_chunk<8>(acc + c, v + c, vs, p, n);
  switch ((Dp - c) / 8) {
    case 7: pv_chunk<7>(acc + c, v + c, vs, p, n); break;
    case 6: pv_chunk<6>(acc + c, v + c, vs, p, n); break;
    case 5: pv_chunk<5>(acc + c, v + c, vs, p, n); break;
    case 4: pv_chunk<4>(acc + c, v + c, vs, p, n); break;
    case 3: pv_chunk<3>(acc + c, v + c, vs, p, n); break;
    case 2: pv_chunk<2>(acc + c, v + c, vs, p, n); break;
    case 1: pv_chunk<1>(acc + c, v + c, vs, p, n); break;
    default: break;
  }
}

// One query vector against rows [lo, n) of a block (krow: n_max rows padded to 8 with zeros; lo > 0
// only under a sliding window): scores (soft-capped when cap > 0: cap * tanh(s / cap), the same in
// log2 units as in natural ones), then the online-softmax update of (m, l, acc).
inline void update(const float* q, const float* const* krow, const float* vrows, int64_t vs, int64_t lo,
                   int64_t n, int64_t n_max, int64_t Dp, float cap, float* s, float& m, float& l,
                   float* acc) {
  const v8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t c0 = lo / 8 * 8;  // lanes before lo in the first chunk are masked like those past n
  v8 mx = splat(kNegInf);
  for (int64_t c8 = c0; c8 < n_max; c8 += 8) {
    v8 a[8] = {};
    for (int64_t d = 0; d < Dp; d += 8) {
      const v8 qd = load8(q + d);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) a[j] += qd * load8(krow[c8 + j] + d);
    }
    const v8 idx = lane + static_cast<float>(c8);
    v8 dots = hsum8(a);
    if (cap > 0.f) {  // Gemma 2 only: a scalar tanh per score is fine there
      for (int j = 0; j < 8; ++j) dots[j] = cap * std::tanh(dots[j] / cap);
    }
    const v8 sc = (idx < splat(static_cast<float>(n))) & (idx >= splat(static_cast<float>(lo))) ? dots
                                                                                               : splat(kNegInf);
    store8(s + c8, sc);
    mx = vmax(mx, sc);
  }
  const float m_new = std::max(m, hmax(mx));
  v8 sum = {};
  for (int64_t c8 = c0; c8 < n_max; c8 += 8) {
    const v8 p = exp2_nonpos(load8(s + c8) - m_new);
    store8(s + c8, p);
    sum += p;
  }
  if (m_new != m) {  // rescale what was accumulated under the old max (nothing while empty)
    const float alpha = m == kNegInf ? 0.f : exp2_nonpos(splat(m - m_new))[0];
    l *= alpha;
    for (int64_t d = 0; d < Dp; d += 8) store8(acc + d, load8(acc + d) * alpha);
    m = m_new;
  }
  l += hsum(sum);
  pv(acc, vrows + lo * vs, vs, s + lo, n - lo, Dp);
}

// Rows [0, n) of a cache block as fp32 with a row stride: the cache itself for fp32 when no padding
// is needed, else converted (and zero-padded to Dp) once per block into buf.
template <typename T>
inline const float* block_rows(const T* src, int64_t tok_stride, int64_t n, const Geometry& g, float* buf,
                               int64_t& stride) {
  const int64_t D = g.head_dim, Dp = g.padded_dim;
  if constexpr (std::is_same_v<T, float>) {
    if (D == Dp) {
      stride = tok_stride;
      return src;
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t d = 0; d < D; ++d) buf[t * Dp + d] = to_float(src[t * tok_stride + d]);
    std::fill(buf + t * Dp + D, buf + (t + 1) * Dp, 0.f);
  }
  stride = Dp;
  return buf;
}

// Prefetch the next block's rows of heads [h0, h1) into L2 (locality 1: prefetcht2, not t0, which
// evicted the block being computed from L1): its address is random, so no hardware prefetcher
// can guess it. Measured on a decode batch larger than L3: -20% time; one block ahead is enough.
template <typename T>
inline void prefetch_block(const T* cache, int64_t block, int64_t block_stride, int64_t tok_stride,
                           int64_t head_stride, int64_t h0, int64_t h1, const Geometry& g) {
  const int64_t row_bytes = g.head_dim * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < g.block_size; ++t) {
    for (int64_t h = h0; h < h1; ++h) {
      const auto* row = reinterpret_cast<const char*>(cache + block * block_stride + t * tok_stride + h * head_stride);
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off, 0, 1);
    }
  }
}

// T: query and output; C: the cache (T itself, or an FP8 type).
template <typename T, typename C>
void run_item(const Geometry& g, const Item& it, const T* q, const C* kc, const C* vc,
              const int32_t* tables, T* out, Scratch& sc) {
  const int64_t G = g.group, D = g.head_dim, Dp = g.padded_dim, BS = g.block_size;
  const int64_t rows = it.row_end - it.row_begin, heads = it.head_end - it.head_begin;
  const int64_t per_row = heads * G, nv = rows * per_row;
  // vector i: row i / per_row, query head head_begin * G + i % per_row (KV head: that / G)
  auto q_head = [&](int64_t i) { return it.head_begin * G + i % per_row; };
  for (int64_t i = 0; i < nv; ++i) {
    const T* src = q + (it.row_begin + i / per_row) * g.q_tok + q_head(i) * g.q_head;
    for (int64_t d = 0; d < D; ++d) sc.q[i * Dp + d] = to_float(src[d]) * g.scale_log2;
    std::fill(&sc.q[i * Dp + D], &sc.q[(i + 1) * Dp], 0.f);
  }
  std::fill_n(sc.acc.data(), nv * Dp, 0.f);
  std::fill_n(sc.m.data(), nv, kNegInf);
  std::fill_n(sc.l.data(), nv, 0.f);
  const int64_t last_pos = it.pos_begin + rows - 1;
  const int32_t* table = tables + it.seq * g.table_stride;
  // Blocks before the first row's window are never read: the scheduler may have freed them.
  for (int64_t b = window_start(it.pos_begin, g.window) / BS; b <= last_pos / BS; ++b) {
    const int64_t base = b * BS;
    const int64_t n_max = std::min(BS, last_pos - base + 1);  // rows of this block anyone sees
    const int64_t block = table[b];  // int64 before multiplying by strides
    if (b < last_pos / BS) {
      prefetch_block(kc, table[b + 1], g.k_block, g.k_tok, g.k_head, it.head_begin, it.head_end, g);
      prefetch_block(vc, table[b + 1], g.v_block, g.v_tok, g.v_head, it.head_begin, it.head_end, g);
    }
    for (int64_t h = it.head_begin; h < it.head_end; ++h) {
      int64_t ks, vs;
      const float* krows = block_rows(kc + block * g.k_block + h * g.k_head, g.k_tok, n_max, g, sc.k.data(), ks);
      const float* vrows = block_rows(vc + block * g.v_block + h * g.v_head, g.v_tok, n_max, g, sc.v.data(), vs);
      for (int64_t t = 0; t < Scratch::pad8(n_max); ++t) sc.krow[t] = t < n_max ? krows + t * ks : sc.zeros.data();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = std::min(n_max, it.pos_begin + r - base + 1);  // lower-right causal
        const int64_t lo = std::max<int64_t>(0, window_start(it.pos_begin + r, g.window) - base);
        if (n <= lo) continue;
        const int64_t first = r * per_row + (h - it.head_begin) * G;
        for (int64_t i = first; i < first + G; ++i) {
          update(&sc.q[i * Dp], sc.krow.data(), vrows, vs, lo, n, n_max, Dp, g.soft_cap_log2, sc.s.data(),
                 sc.m[i], sc.l[i], &sc.acc[i * Dp]);
        }
      }
    }
  }
  for (int64_t i = 0; i < nv; ++i) {
    T* dst = out + (it.row_begin + i / per_row) * g.out_tok + q_head(i) * D;
    const float inv = 1.f / sc.l[i];  // l >= 1: the max score contributes 2^0
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(sc.acc[i * Dp + d] * inv);
  }
}

}  // namespace pagoda_cpu
