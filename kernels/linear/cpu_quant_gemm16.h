// The prefill (many activation rows) path of the quantized linear on AVX512-VNNI CPUs
// (cpu_quant_gemm16.cpp): the integer weight codes times activations quantized to int16 per 32,
// as the decode rows' int16 path (cpu_quant_int16dot.cpp) does, but as a GEMM.
#pragma once

#include <cstdint>
#include <functional>

namespace pagoda_cpu {

// Weight row n: its K codes minus the zero point (q - zero, as int16) and its K/group scales.
using CodeRow = std::function<void(int64_t n, int16_t* codes, float* scales)>;

// Whether a call with activation precision `act` (kActDefault / 8 / 16 / 32) of a weight in
// groups of `group` over K columns takes int16_gemm: the AVX512-VNNI kernel is in use, the call
// (or the default) is not fp32 (act 8, asked of decode rows, gets int16 here: more exact, as fast),
// K % 32 == 0 and the group is 16 or a multiple of 32.
bool int16_gemm_applies(int64_t act, int64_t K, int64_t group);

// out [M, N] = x [M, K] fp32 @ W.T (+ mins' term, + bias), W[n, k] = scales[n, g] * code + mins[n, g]:
// x quantized per row and block of 32 to int16 (d = max|x| / 32767, round half to even), int32
// sums of code * x_q over each block of 32 (16 for group 16), each scaled by s * d into fp32.
// mins: fp32 [N, K/group] or nullptr. Only where int16_gemm_applies.
void int16_gemm(const float* x, int64_t M, int64_t K, int64_t N, int64_t group, const CodeRow& row,
                const float* mins, const float* bias, float* out);

}  // namespace pagoda_cpu
