// The whole decoder stack of a Llama-family model for one pure-decode step, as one torch op:
// `pagoda_cpu::decode_stack` (worker_svc/models/fused_decode.py collects its weights and decides
// when it may run).
//
// Why: at batch 1 a decode step's matmuls take ~10 ms on SmolLM2, but the Python module loop
// around them ran ~50 aten ops and ~15 module calls per layer (RMSNorm, RoPE, split/view, silu,
// residual adds), each several microseconds of Python + dispatcher: another ~10 ms per step.
// Here the small element-wise work is plain loops over the rows, and the heavy parts are the very
// functions the module path runs: oneDNN's packed linear (mkldnn::_linear_pointwise, handle
// resolved once), the quantized linear and the paged attention of this extension (called
// directly, not through the dispatcher), so their outputs are the same bits.
//
// Per layer (pre-norm, as worker_svc/models/llama.py's DecoderLayer):
//   h = rmsnorm(x) -> qkv -> RoPE(q, k) -> KV write -> paged attention -> o_proj -> x += .
//   h = rmsnorm(x) -> gate_up -> silu(gate) * up -> down -> x += .
// then the final norm. Element-wise steps round where the module path rounds: in bf16 each
// product and sum of RMSNorm, RoPE, SiLU-and-mul and the residual is rounded to bf16 as the
// separate aten ops round it; in fp32 only the order of RMSNorm's sum of squares (and FMA
// contraction) differs, i.e. ~1e-7 relative.
//
// Linears, per projection, by `meta` (kind, group, bits, zero):
//   kind 0: oneDNN-packed weight; rows padded with zeros up to `padded_rows` (the row bucket of
//           worker_svc/models/row_buckets.py, so oneDNN's primitive cache sees the same shapes);
//   kind 1: weight-only int8 / int4 (scales, optional mins), as quant_linear.py (no padding: no
//           primitive cache there);
//   kind 2: a plain row-major weight (at::linear), where oneDNN cannot pack the dtype.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "../linear/cpu_quant_linear.h"
#include "../paged_attention/cpu_attention.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace {

constexpr int64_t kLinearsPerLayer = 4;  // qkv_proj, o_proj, gate_up_proj, down_proj
constexpr int64_t kMetaPerLinear = 4;    // kind, group, bits, zero
enum Kind : int64_t { kPacked = 0, kQuant = 1, kDense = 2 };

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   std::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<std::string_view>);

const c10::TypedOperatorHandle<LinearPointwise>& linear_pointwise() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<LinearPointwise>();
  return op;
}

struct Linear {
  int64_t kind, group, bits, zero;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& scales;
  const std::optional<at::Tensor>& mins;
  const std::optional<at::Tensor>& bias;
};

// x [M, in] contiguous -> [M, out] in x's dtype.
at::Tensor run_linear(const Linear& l, const at::Tensor& x, int64_t padded_rows) {
  if (l.kind == kQuant) {
    return pagoda_cpu::quant_linear(x, l.weight, *l.scales, l.mins, l.bias, l.group, l.bits, l.zero);
  }
  if (l.kind == kDense) return at::linear(x, l.weight, l.bias);
  const int64_t M = x.size(0);
  at::Tensor in = x;
  if (padded_rows > M) {  // zero rows up to the bucket; their outputs are sliced off (a view)
    in = at::zeros({padded_rows, x.size(1)}, x.options());
    in.narrow(0, 0, M).copy_(x);
  }
  at::Tensor out = linear_pointwise().call(in, l.weight, l.bias, "none", c10::List<std::optional<at::Scalar>>(),
                                           std::optional<std::string_view>(""));
  return padded_rows > M ? out.narrow(0, 0, M) : out;
}

// Rounding to the activation dtype: a no-op for fp32, round-to-nearest-even for bf16.
template <typename T>
inline float r(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), statistics in fp32 (common.py RMSNorm).
template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * H;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < H; ++k) ss += static_cast<float>(xr[k]) * static_cast<float>(xr[k]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    T* o = out + m * H;
    for (int64_t k = 0; k < H; ++k) {
      o[k] = static_cast<T>(static_cast<float>(w[k]) * r<T>(static_cast<float>(xr[k]) * inv));
    }
  }
}

// Neox RoPE in place on `heads` heads of D at `x` (rotate-half; cos, sin [D] of this position).
template <typename T>
void rope(T* x, int64_t heads, int64_t D, const T* cos, const T* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h, x += D) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product rounded, then the sum
      x[i] = static_cast<T>(r<T>(x1 * static_cast<float>(cos[i])) + r<T>(-x2 * static_cast<float>(sin[i])));
      x[i + half] = static_cast<T>(r<T>(x2 * static_cast<float>(cos[i + half])) +
                                   r<T>(x1 * static_cast<float>(sin[i + half])));
    }
  }
}

// gate_up [M, 2I] (gate first) -> out [M, I] = silu(gate) * up
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m) {
    const T* g = gate_up + m * 2 * I;
    const T* u = g + I;
    T* o = out + m * I;
    for (int64_t k = 0; k < I; ++k) {
      const float gv = g[k];
      o[k] = static_cast<T>(r<T>(gv / (1.0f + std::exp(-gv))) * static_cast<float>(u[k]));
    }
  }
}

// x [M, H] += delta [M, H] (contiguous rows)
template <typename T>
void add_into(T* x, const T* delta, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(delta[i]));
}

std::vector<std::optional<at::Tensor>> unpack(const c10::List<std::optional<at::Tensor>>& list) {
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) out.push_back(list.get(i));
  return out;
}

struct Shapes {
  int64_t M, H, Hq, Hkv, D;
};

template <typename T>
at::Tensor run_stack(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& cos_sin,
                     at::TensorList norms, at::TensorList weights,
                     const std::vector<std::optional<at::Tensor>>& scales,
                     const std::vector<std::optional<at::Tensor>>& mins,
                     const std::vector<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
                     at::TensorList k_caches, at::TensorList v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const Shapes& s, double scale, double eps,
                     int64_t padded_rows) {
  const int64_t M = s.M, H = s.H, D = s.D, q_size = s.Hq * D, kv_size = s.Hkv * D;
  const int64_t L = static_cast<int64_t>(k_caches.size());
  at::Tensor x = x_in.contiguous().clone();  // the residual stream [M, H], updated in place
  T* xp = x.mutable_data_ptr<T>();
  at::Tensor h = at::empty({M, H}, x.options());  // normed input of the next projection
  T* hp = h.mutable_data_ptr<T>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const T* cs = cos_sin.const_data_ptr<T>();
  const int64_t cs_stride = cos_sin.stride(0), P = cos_sin.size(0);
  for (int64_t m = 0; m < M; ++m) TORCH_CHECK(pos[m] >= 0 && pos[m] < P, "position ", pos[m], " outside RoPE's cache");
  const float feps = static_cast<float>(eps);
  auto linear = [&](int64_t layer, int64_t which) {
    const int64_t i = layer * kLinearsPerLayer + which;
    const int64_t* mt = meta.data() + i * kMetaPerLinear;
    return Linear{mt[0], mt[1], mt[2], mt[3], weights[i], scales[i], mins[i], biases[i]};
  };
  for (int64_t layer = 0; layer < L; ++layer) {
    rms_norm<T>(xp, norms[2 * layer].const_data_ptr<T>(), hp, M, H, feps);
    at::Tensor qkv = run_linear(linear(layer, 0), h, padded_rows).contiguous();  // [M, q + 2 kv]
    T* qkvp = qkv.mutable_data_ptr<T>();
    const int64_t row = qkv.size(1);
    for (int64_t m = 0; m < M; ++m) {
      const T* c = cs + pos[m] * cs_stride;
      rope<T>(qkvp + m * row, s.Hq, D, c, c + D);
      rope<T>(qkvp + m * row + q_size, s.Hkv, D, c, c + D);
    }
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({M, s.Hq, D});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({M, s.Hkv, D});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({M, s.Hkv, D});
    pagoda_cpu::write_kv_cache(k, v, k_caches[layer], v_caches[layer], slot_mapping);
    const at::Tensor attn = pagoda_cpu::paged_attention(q, k_caches[layer], v_caches[layer], block_tables,
                                                        seq_lens, query_start_loc, scale, 0, 0.0);
    at::Tensor o = run_linear(linear(layer, 1), attn.view({M, q_size}), padded_rows).contiguous();
    add_into<T>(xp, o.const_data_ptr<T>(), M * H);
    rms_norm<T>(xp, norms[2 * layer + 1].const_data_ptr<T>(), hp, M, H, feps);
    const at::Tensor gate_up = run_linear(linear(layer, 2), h, padded_rows).contiguous();  // [M, 2I]
    const int64_t I = gate_up.size(1) / 2;
    at::Tensor act = at::empty({M, I}, x.options());
    silu_and_mul<T>(gate_up.const_data_ptr<T>(), act.mutable_data_ptr<T>(), M, I);
    at::Tensor down = run_linear(linear(layer, 3), act, padded_rows).contiguous();
    add_into<T>(xp, down.const_data_ptr<T>(), M * H);
  }
  if (norms.size() == static_cast<size_t>(2 * L)) return x;  // a pipeline stage before the last: no final norm
  rms_norm<T>(xp, norms[2 * L].const_data_ptr<T>(), hp, M, H, feps);
  return h;
}

at::Tensor decode_stack(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                        at::TensorList norms, at::TensorList weights,
                        const c10::List<std::optional<at::Tensor>>& scales_in,
                        const c10::List<std::optional<at::Tensor>>& mins_in,
                        const c10::List<std::optional<at::Tensor>>& biases_in, at::IntArrayRef meta,
                        at::TensorList k_caches, at::TensorList v_caches,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const at::Tensor& query_start_loc, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, double scale, double eps, int64_t padded_rows) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  const auto n_lin = static_cast<size_t>(L * kLinearsPerLayer);
  const std::vector<std::optional<at::Tensor>> scales = unpack(scales_in), mins = unpack(mins_in),
                                               biases = unpack(biases_in);
  TORCH_CHECK(L > 0 && v_caches.size() == k_caches.size(), "one (k, v) cache pair per layer");
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * L + 1) || norms.size() == static_cast<size_t>(2 * L),
              "2 norms per layer, then the final one (absent on a pipeline stage before the last) expected");
  TORCH_CHECK(weights.size() == n_lin && scales.size() == n_lin && mins.size() == n_lin && biases.size() == n_lin &&
                  meta.size() == n_lin * kMetaPerLinear,
              "4 linears per layer (qkv, o, gate_up, down), each with its scales, mins, bias and 4 meta ints");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be CPU [num_tokens, hidden]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be contiguous int64 [num_tokens]");
  TORCH_CHECK(head_dim % 2 == 0 && cos_sin.dim() == 2 && cos_sin.size(1) == 2 * head_dim && cos_sin.stride(1) == 1 &&
                  cos_sin.scalar_type() == x.scalar_type(),
              "cos_sin must be [positions, 2 * head_dim] in x's dtype (full rotary)");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc must have num_seqs + 1 entries");
  for (const auto& n : norms) {
    TORCH_CHECK(n.is_contiguous() && n.numel() == x.size(1) && n.scalar_type() == x.scalar_type(),
                "norm weights must be contiguous [hidden] in x's dtype");
  }
  for (size_t i = 0; i < n_lin; ++i) {
    const int64_t kind = meta[i * kMetaPerLinear];
    TORCH_CHECK(kind == kPacked || kind == kQuant || kind == kDense, "linear ", i, ": unknown kind ", kind);
    TORCH_CHECK(kind != kQuant || scales[i].has_value(), "linear ", i, ": a quantized linear needs scales");
  }
  const Shapes s{x.size(0), x.size(1), num_heads, num_kv_heads, head_dim};
  TORCH_CHECK(padded_rows >= s.M, "padded_rows ", padded_rows, " < num_tokens ", s.M);
  switch (x.scalar_type()) {
    case at::kFloat:
      return run_stack<float>(x, positions, cos_sin, norms, weights, scales, mins, biases, meta, k_caches, v_caches,
                              slot_mapping, block_tables, seq_lens, query_start_loc, s, scale, eps, padded_rows);
    case at::kBFloat16:
      return run_stack<c10::BFloat16>(x, positions, cos_sin, norms, weights, scales, mins, biases, meta, k_caches,
                                      v_caches, slot_mapping, block_tables, seq_lens, query_start_loc, s, scale, eps,
                                      padded_rows);
    default:
      TORCH_CHECK(false, "pagoda_cpu.decode_stack: activations must be float32 or bfloat16, got ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("decode_stack(Tensor x, Tensor positions, Tensor cos_sin, Tensor[] norms, Tensor[] weights, "
        "Tensor?[] scales, Tensor?[] mins, Tensor?[] biases, int[] meta, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
        "int num_heads, int num_kv_heads, int head_dim, float scale, float eps, int padded_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("decode_stack", &decode_stack); }

// oneDNN-packed weights are MkldnnCPU tensors, and the dispatcher picks the key from every tensor
// argument: the same CPU kernel serves that key.
TORCH_LIBRARY_IMPL(pagoda_cpu, MkldnnCPU, m) { m.impl("decode_stack", &decode_stack); }
