// The int8 dot-product path of the quantized linear (cpu_quant_int8dot.cpp), for
// cpu_quant_linear.cpp's decode rows: 8-bit weight codes times activations quantized to int8.
#pragma once

#include <cstdint>
#include <type_traits>

namespace pagoda_cpu {

// Which int8 dot-product kernel runs, decided once per process from the CPU and PAGODA_INT8_DOT
// (and changed by the op `quant_int8_dot`, for tests that compare both paths).
enum Int8Dot : int64_t { kInt8DotOff = 0, kInt8DotAvx512Vnni = 1, kInt8DotAvxVnni = 2 };

// The activations' precision on that path, per call (the op quant_linear's `act`): kActDefault takes
// the process default (PAGODA_INT8_DOT, or the op `quant_int8_dot`); kActFp32 the exact fp32 path.
enum Act : int64_t { kActDefault = 0, kActInt8 = 8, kActInt16 = 16, kActFp32 = 32 };
int64_t act_default();

// The CPU's best kernel (kInt8DotOff: no VNNI), ignoring the switch.
int64_t int8_dot_supported();
// The kernel in use now (the switch applied).
int64_t int8_dot_mode();

// x [M, K] fp32 (rows contiguous) against int8 codes q [N, K] with fp32 scales [N, K/group]
// (mins [N, K/group] or nullptr): w = scales * q (+ mins); 8-bit codes have no zero point. Each
// activation row is quantized to int8 per 32 elements (d = max|x| / 127, round to nearest even),
// the products are int32 dot products, scaled per 32-element block:
// out[m, n] = sum_b s_g(b) d_b sum_{k in b} q x_q (+ mins * sum x_q d over each group) + bias.
// Returns false (nothing written) where the path does not apply: mode off, act kActFp32 (or a
// default of fp32), group % 32 != 0 and not 16. act kActInt16: int16_dot_linear.
// half_scales: fp16 scales [N, K/32] in place of `scales` (groups of 32, no mins: GGUF Q8_0's own,
// kept as stored), read as they are by both integer paths; false for a call that takes the fp32
// path (or another group): the caller then widens them to fp32 and goes on.
bool int8_dot_linear(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scales,
                     const float* mins, int64_t N, int64_t group, const float* bias, float* out,
                     int64_t act = kActDefault, const uint16_t* half_scales = nullptr);

// The same with activations quantized to int16 per 32 (d = max|x| / 32767) and vpdpwssd
// (cpu_quant_int16dot.cpp), with the kernel family `mode` (kInt8DotAvx512Vnni / kInt8DotAvxVnni).
bool int16_dot_linear(int64_t mode, const float* x, int64_t M, int64_t K, const int8_t* q, const float* scales,
                      const float* mins, int64_t N, int64_t group, const float* bias, float* out,
                      const uint16_t* half_scales = nullptr);

// Row-interleaved 8-bit codes in groups of 32 without mins (worker_svc/models/quant_linear.py,
// interleave_rows): q [N/16][K/2][16][2] int8 -- for each 16 output rows, each pair of columns holds
// the 16 rows' two codes side by side -- and scales [N/16][K/32][16] (fp32 `scales`, or fp16
// `half_scales`). One vpdpwssd then multiplies an activation pair into 16 output rows, and the
// weights stream from memory in one sequential pass. Activations int16 per 32, as int16_dot_linear.
// Returns false (nothing written) unless the AVX512-VNNI kernel is in use, `act` (or the default)
// is kActInt16, K % 32 == 0 and N % 16 == 0: the caller then widens the rows itself.
bool int16_dot_linear_interleaved(int64_t act, const float* x, int64_t M, int64_t K, const int8_t* q,
                                  const float* scales, const uint16_t* half_scales, int64_t N, const float* bias,
                                  float* out);

// Packed 4-, 5- and 6-bit codes as cpu_quant_linear.cpp / cpu_quant_linear_lowbit.cpp store them
// (blocks of 32: 16 bytes of nibbles, element i low and i + 16 high, then for 5 bits a 32-bit plane
// of fifth bits, for 6 bits a 64-bit plane of top-bit pairs; 4 bits: groups of 32 only), w = scales
// * (q - zero) (+ mins), with int16 activations, where the AVX512-VNNI kernel is in use and the
// process default is int16; false (nothing written) otherwise.
bool int16_dot_packed(const float* x, int64_t M, int64_t K, const uint8_t* q, int64_t bits, int64_t zero,
                      const float* scales, const float* mins, int64_t N, int64_t group, const float* bias,
                      float* out);

// The activation rows of one block of weight rows, in tiles of 4 then the remainder (the weight rows
// stay in L1 across the tiles): emit(std::integral_constant<int, MT>, m0) for each tile of MT rows.
template <typename Emit>
inline void for_row_tiles(int64_t M, Emit&& emit) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) emit(std::integral_constant<int, 4>{}, m0);
  switch (M - m0) {
    case 3: emit(std::integral_constant<int, 3>{}, m0); break;
    case 2: emit(std::integral_constant<int, 2>{}, m0); break;
    case 1: emit(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

}  // namespace pagoda_cpu
