// The many-rows path shared by every quantized storage (cpu_quant_linear.cpp: 8 and 4 bits;
// cpu_quant_linear_lowbit.cpp: 5 and 6 bits): a prefill chunk is compute-bound, so the weights are
// widened block by block into fp32 scratch and multiplied by ATen's GEMM at full speed.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace pagoda_cpu {

// A linear's optional bias as contiguous fp32 with N entries (undefined when there is none).
inline at::Tensor fp32_bias(const std::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return {};
  at::Tensor b = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(b.numel() == N, "bias must have N entries");
  return b;
}

// out [M, N] = x [M, K] fp32 @ W.T (+ bias), where dequant_row(n, dst) writes W's row n as K floats.
template <typename DequantRow>
void blocked_quant_matmul(int64_t N, int64_t K, const at::Tensor& x, at::Tensor& out, const float* bias,
                          DequantRow dequant_row) {
  // ~4 MiB of fp32 rows per block (>= 64 rows): large enough for a GEMM at full speed.
  const int64_t rows = std::min<int64_t>(N, std::max<int64_t>(64, (int64_t{1} << 20) / std::max<int64_t>(K, 1)));
  at::Tensor scratch = at::empty({rows, K}, x.options());
  float* s = scratch.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t r = std::min(rows, N - n0);
    at::parallel_for(0, r, 8, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dequant_row(n0 + i, s + i * K);
    });
    at::Tensor part = at::mm(x, scratch.narrow(0, 0, r).t());  // [M, r]
    if (bias) {  // added after the product, as the direct paths do: (x . w) + b rounds the same way
      float* p = part.data_ptr<float>();
      for (int64_t m = 0; m < part.size(0); ++m)
        for (int64_t i = 0; i < r; ++i) p[m * r + i] += bias[n0 + i];
    }
    out.narrow(1, n0, r).copy_(part);
  }
}

}  // namespace pagoda_cpu
