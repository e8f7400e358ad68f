// The 5- and 6-bit weight-only linear (cpu_quant_linear_lowbit.cpp): pagoda_cpu::quant_linear and
// quant_dequantize hand bits 5 / 6 to these, so the fused decode stack reads them unchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace pagoda_cpu {

// x [M, K] fp32/bf16 @ dequantised(qweight).T (+ bias) -> [M, N] in x's dtype; bits 5 or 6.
at::Tensor quant_linear_lowbit(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                               int64_t group, int64_t bits, int64_t zero, int64_t act = 0);

// The weights themselves, fp32 [N, K], bit-identical to gguf's dequantisation.
at::Tensor quant_dequantize_lowbit(const at::Tensor& qweight, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& mins, int64_t K, int64_t group, int64_t bits,
                                   int64_t zero);

}  // namespace pagoda_cpu
