// The weight-only quantized linear of cpu_quant_linear.cpp, for other C++ sources of the same
// extension (the fused decode stack) to call without going through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace pagoda_cpu {

// x [M, K] fp32/bf16 @ dequantised(qweight).T (+ bias) -> [M, N] in x's dtype; see the .cpp.
// act: the activations' precision for 8-bit codes at decode (cpu_quant_int8dot.h's Act; 0 the default).
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                        int64_t group, int64_t bits, int64_t zero, int64_t act = 0);

}  // namespace pagoda_cpu
