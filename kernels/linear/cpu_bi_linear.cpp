// Batch-invariant bf16 linear for CPU: `pagoda_cpu::bi_linear`.
//
// Why: oneDNN (and MKL) pick a different kernel and blocking for each number of rows M, so a row's
// bf16 result depends on how many rows share the GEMM. Speculative decoding verifies K+1 positions
// of a sequence in one pass where plain decoding computes one, so greedy bf16 outputs drifted with
// speculation on (docs/speculative_decoding.md). Here every output element is one fixed sequence of
// fp32 accumulations over K, whatever M is and whichever rows sit beside it: rows never share an
// accumulator, the K order is the same for every tile, and padding rows are zeros in their own lanes.
//
// Two paths, chosen once per process (a machine always takes the same one, which is what invariance
// needs; the two do not agree with each other bit for bit):
// - AMX (Sapphire Rapids and later): TDPBF16PS over 16x32 bf16 A tiles and 16x(16 pairs) B tiles in
//   VNNI layout, two 16x16 fp32 C tiles per 32 output columns. Each weight tile is read from DRAM once
//   per call and reused for every 16-row block of the activations.
// - elsewhere: the same VNNI-packed weights, fp32 multiply-adds in the order k = 0, 1, 2, ... per
//   output, vectorised across 16 output columns (the compiler's AVX2/AVX-512 lanes), slower.
//
// Weight layout (made once at load by worker_svc/models/batch_invariant_linear.py `pack_weight`):
//   packed[N_pad / 16][K_pad / 32][16 (k pairs)][16 (columns)][2] bf16, zero padded,
// i.e. per 16-column block and 32-wide K step, exactly the 1 KiB B tile TDPBF16PS loads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t kCols = 16;  // columns per B tile
constexpr int64_t kKStep = 32;  // bf16 K elements per tile row (64 bytes)
constexpr int64_t kRows = 16;  // activation rows per A / C tile

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as c10::BFloat16 does
  return c10::BFloat16(f).x;
}

// -- AMX path ----------------------------------------------------------------------------------------

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx_permission() {
  // Linux hands out the AMX tile state only on request (once per process; repeating it is harmless).
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool amx_usable() {
  // PAGODA_BI_LINEAR_PORTABLE=1 takes the portable path on an AMX machine (its tests run it there).
  static const bool usable = std::getenv("PAGODA_BI_LINEAR_PORTABLE") == nullptr &&
                             __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") &&
                             request_amx_permission();
  return usable;
}

__attribute__((target("amx-tile,amx-bf16,avx512f")))
void amx_block(const uint16_t* a, int64_t a_stride_bytes, const uint16_t* b_blocks, int64_t kb_count,
               int64_t nb0, int64_t nb_count, float* c, int64_t c_stride_bytes) {
  // C[16 x 16*nb_count] = A[16 x K_pad] . B; nb_count is 1 or 2 (two C tiles share one A tile load).
  const int64_t tile_elems = (kKStep / 2) * kCols * 2;  // 512 bf16 = 1 KiB
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    _tile_loadd(2, a + kb * kKStep, a_stride_bytes);
    _tile_loadd(3, b_blocks + (nb0 * kb_count + kb) * tile_elems, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (nb_count == 2) {
      _tile_loadd(4, b_blocks + ((nb0 + 1) * kb_count + kb) * tile_elems, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  _tile_stored(0, c, c_stride_bytes);
  if (nb_count == 2) _tile_stored(1, c + kCols, c_stride_bytes);
}

__attribute__((target("amx-tile,amx-bf16,avx512f")))
void amx_pairs(const uint16_t* x_pad, int64_t m_pad, int64_t k_pad, const uint16_t* w, int64_t n_blocks,
               float* out32, int64_t n_pad, int64_t begin, int64_t end) {
  // Column pairs [begin, end) on this thread (a lambda would not inherit the AMX target attribute).
  const int64_t kb_count = k_pad / kKStep;
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = kRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  for (int64_t p = begin; p < end; ++p) {
    const int64_t nb0 = 2 * p, nb_count = std::min<int64_t>(2, n_blocks - nb0);
    // Rows inside, columns outside: this pair's weights (K_pad x 32 bf16, <= 100 KiB) stay in L2
    // while every 16-row block of the activations passes over them.
    for (int64_t m0 = 0; m0 < m_pad; m0 += kRows) {
      amx_block(x_pad + m0 * k_pad, k_pad * 2, w, kb_count, nb0, nb_count,
                out32 + m0 * n_pad + nb0 * kCols, n_pad * 4);
    }
  }
  _tile_release();
}

void amx_linear(const uint16_t* x_pad, int64_t m_pad, int64_t k_pad, const uint16_t* w, int64_t n_blocks,
                float* out32, int64_t n_pad) {
  at::parallel_for(0, (n_blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    amx_pairs(x_pad, m_pad, k_pad, w, n_blocks, out32, n_pad, begin, end);
  });
}

// -- portable path -----------------------------------------------------------------------------------

void portable_linear(const uint16_t* x, int64_t m, int64_t k, int64_t k_pad, const uint16_t* w,
                     int64_t n_blocks, float* out32, int64_t n_pad) {
  const int64_t kb_count = k_pad / kKStep;
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t r = 0; r < m; ++r) {
        float acc[kCols] = {};
        const uint16_t* xr = x + r * k_pad;
        for (int64_t kb = 0; kb < kb_count; ++kb) {
          const uint16_t* tile = w + (nb * kb_count + kb) * (kKStep / 2) * kCols * 2;
          for (int64_t kp = 0; kp < kKStep / 2; ++kp) {
            const int64_t kk = kb * kKStep + 2 * kp;
            if (kk >= k) break;  // zero padding beyond K adds nothing
            const float a0 = bf16_to_float(xr[kk]), a1 = bf16_to_float(xr[kk + 1]);
            const uint16_t* bp = tile + kp * kCols * 2;
#pragma omp simd
            for (int64_t c = 0; c < kCols; ++c) {
              acc[c] += a0 * bf16_to_float(bp[2 * c]);
              acc[c] += a1 * bf16_to_float(bp[2 * c + 1]);
            }
          }
        }
        std::memcpy(out32 + r * n_pad + nb * kCols, acc, sizeof acc);
      }
    }
  });
}

// -- op ----------------------------------------------------------------------------------------------

at::Tensor bi_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bi_linear: bf16 activations and weights");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 5, "bi_linear: x [M, K], packed [N/16, K/32, 16, 16, 2]");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t n_blocks = packed.size(0), k_pad = packed.size(1) * kKStep, n_pad = n_blocks * kCols;
  TORCH_CHECK(k <= k_pad && k_pad - k < kKStep, "bi_linear: K ", k, " does not match the packed weight");
  TORCH_CHECK(out_features <= n_pad && n_pad - out_features < kCols, "bi_linear: bad out_features");
  const at::Tensor w = packed.contiguous();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr<c10::BFloat16>());

  const bool amx = amx_usable();
  // Activations copied once into a zero-padded [M_pad, K_pad] buffer: whole tiles, no edge cases,
  // and the padding lanes are zeros that never reach a real output.
  const int64_t m_pad = amx ? (m + kRows - 1) / kRows * kRows : m;
  at::Tensor x_pad = at::zeros({m_pad, k_pad}, x.options());
  x_pad.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
  const auto* xp = reinterpret_cast<const uint16_t*>(x_pad.const_data_ptr<c10::BFloat16>());
  at::Tensor out32 = at::empty({m_pad, n_pad}, x.options().dtype(at::kFloat));
  float* op = out32.mutable_data_ptr<float>();
  if (amx) {
    amx_linear(xp, m_pad, k_pad, wp, n_blocks, op, n_pad);
  } else {
    portable_linear(xp, m, k, k_pad, wp, n_blocks, op, n_pad);
  }
  at::Tensor out = at::empty({m, out_features}, x.options());
  auto* dst = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < out_features; ++c) dst[r * out_features + c] = float_to_bf16(op[r * n_pad + c]);
    }
  });
  return out;
}

bool bi_linear_uses_amx() { return amx_usable(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("bi_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("bi_linear_uses_amx() -> bool", &bi_linear_uses_amx);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("bi_linear", &bi_linear);
}
