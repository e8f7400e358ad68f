// Compiled CPU paged attention and KV-cache write: torch custom ops `pagoda_cpu::*`.
//
// Semantics are those of kernels/__init__.py (cache [num_blocks, block_size, Hkv, D], lower-right
// causal, optional sliding window, optional logits soft cap, GQA, rows outside every sequence zero). K/V are read in place, block by block through the
// block table: no gather, no padding. One code path serves decode rows and prefill chunks over a
// cached prefix: a work item is (sequence, KV heads, tile of query rows) and runs a flash-style
// online softmax over the blocks its last row can see; every query head of a KV group is in the
// tile, so each K/V row is read (and, for bf16/fp16/fp8, converted) once per tile. Accumulation is fp32.
// Items are handed out dynamically, longest first, on torch's thread pool.
//
// Registered as torch ops (not a pybind module) so the extension needs only light headers (a fast
// build) and stays traceable by torch.compile through the fake kernels in kernels/cpu_extension.py.
// Threads come from at::parallel_for, i.e. torch's own OpenMP pool and torch.set_num_threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_attention.h"
#include "cpu_attention_kernel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using pagoda_cpu::Geometry;
using pagoda_cpu::Item;

// Query vectors (rows x group heads) per prefill tile: enough to amortise each K/V block read,
// few enough that the tile's q and accumulators stay in L1/L2 and long chunks split across threads.
constexpr int64_t kTileVectors = 32;  // 16..128 measured: no difference on 512-row chunks
// A sequence with at most this many query vectors (decode rows, short chunks) is one item over
// all its KV heads, so each block (heads interleaved in it) is fetched as one contiguous run rather
// than in head-strided passes by different items: measured 0-20% faster on decode batches larger
// than L3 (the most on bf16). Too few items for the threads -> split per head again (plan_items).
constexpr int64_t kWholeVectors = 64;


// Work items, checked against the cache before any runs: a bad table must fail, never read wild.
std::vector<Item> plan_items(const at::Tensor& tables, const at::Tensor& seq_lens, const at::Tensor& qsl,
                             int64_t num_rows, int64_t num_kv_heads, int64_t group, int64_t block_size,
                             int64_t num_blocks, int64_t window, int64_t threads, std::vector<uint8_t>& covered) {
  const int64_t B = seq_lens.size(0), max_blocks = tables.size(1);
  TORCH_CHECK(qsl.size(0) == B + 1, "query_start_loc must have num_seqs + 1 entries");
  TORCH_CHECK(tables.size(0) >= B, "block_tables has fewer rows than seq_lens");
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* starts = qsl.const_data_ptr<int32_t>();
  const int32_t* table = tables.const_data_ptr<int32_t>();
  // Prefill chunks split into row tiles so that long ones spread over threads; decode rows are 1.
  const int64_t tile_rows = std::max<int64_t>(1, kTileVectors / group);
  std::vector<Item> items;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t start = starts[i], q_len = starts[i + 1] - start, seq_len = lens[i];
    if (q_len == 0) continue;  // padding sequence
    TORCH_CHECK(q_len > 0 && start >= 0 && start + q_len <= num_rows, "sequence ", i,
                ": query rows [", start, ", ", start + q_len, ") outside the ", num_rows, " rows");
    TORCH_CHECK(q_len <= seq_len, "sequence ", i, ": q_len ", q_len, " > seq_len ", seq_len);
    TORCH_CHECK(seq_len <= max_blocks * block_size, "sequence ", i, ": seq_len ", seq_len,
                " exceeds its block table (", max_blocks, " blocks)");
    const int64_t pos0 = seq_len - q_len;
    // Only blocks some row can see: those before the first row's window may be placeholders.
    for (int64_t b = pagoda_cpu::window_start(pos0, window) / block_size;
         b < (seq_len + block_size - 1) / block_size; ++b) {
      const int64_t id = table[i * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", i, ": block id ", id, " out of range");
    }
    for (int64_t r = start; r < start + q_len; ++r) {
      TORCH_CHECK(!covered[r], "query row ", r, " belongs to two sequences");
      covered[r] = 1;
    }
    // Context a row reads: all of it, or at most window positions.
    auto seen = [&](int64_t pos) { return window > 0 ? std::min(pos + 1, window) : pos + 1; };
    if (q_len * group * num_kv_heads <= kWholeVectors) {
      items.push_back({i, 0, num_kv_heads, start, start + q_len, pos0, q_len * group * num_kv_heads * seen(seq_len - 1)});
      continue;
    }
    for (int64_t row = start; row < start + q_len; row += tile_rows) {
      const int64_t end = std::min(row + tile_rows, start + q_len);
      const int64_t pos_begin = pos0 + (row - start);
      const int64_t cost = (end - row) * group * seen(end - 1 - row + pos_begin);  // vectors x context
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({i, h, h + 1, row, end, pos_begin, cost});
    }
  }
  if (static_cast<int64_t>(items.size()) < 2 * threads && num_kv_heads > 1) {  // too few to share out
    std::vector<Item> split;
    for (const Item& it : items) {
      for (int64_t h = it.head_begin; h < it.head_end; ++h) {
        Item one = it;
        one.head_begin = h;
        one.head_end = h + 1;
        one.cost = it.cost / (it.head_end - it.head_begin);
        split.push_back(one);
      }
    }
    items.swap(split);
  }
  // Longest first, then dynamic hand-out: the tail is made of the cheapest items (LPT balancing).
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename T, typename C = T>
void run_items(const Geometry& g, const std::vector<Item>& items, const at::Tensor& query,
               const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
               at::Tensor& out) {
  const T* q = query.const_data_ptr<T>();
  const C* kc = k_cache.const_data_ptr<C>();
  const C* vc = v_cache.const_data_ptr<C>();
  const int32_t* tb = tables.const_data_ptr<int32_t>();
  T* o = out.mutable_data_ptr<T>();
  int64_t max_vectors = 1;
  for (const Item& it : items) {
    max_vectors = std::max(max_vectors, (it.row_end - it.row_begin) * (it.head_end - it.head_begin) * g.group);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    pagoda_cpu::Scratch sc(max_vectors, g);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      pagoda_cpu::run_item(g, items[i], q, kc, vc, tb, o, sc);
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);  // at::parallel_for's pool
  if (threads <= 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, threads, 1, work);  // one chunk per thread; items handed out dynamically
  }
}

template <typename C>
void run_fp8_cache_as(const Geometry& g, const std::vector<Item>& items, const at::Tensor& query,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                      at::Tensor& out) {
  switch (query.scalar_type()) {
    case at::kFloat: run_items<float, C>(g, items, query, k_cache, v_cache, tables, out); break;
    case at::kBFloat16: run_items<c10::BFloat16, C>(g, items, query, k_cache, v_cache, tables, out); break;
    case at::kHalf: run_items<c10::Half, C>(g, items, query, k_cache, v_cache, tables, out); break;
    default: TORCH_CHECK(false, "pagoda_cpu.paged_attention: unsupported query dtype ", query.scalar_type());
  }
}

void run_fp8_cache(const Geometry& g, const std::vector<Item>& items, const at::Tensor& query,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                   at::Tensor& out) {
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    run_fp8_cache_as<c10::Float8_e4m3fn>(g, items, query, k_cache, v_cache, tables, out);
  } else {
    run_fp8_cache_as<c10::Float8_e5m2>(g, items, query, k_cache, v_cache, tables, out);
  }
}

}  // namespace

// Exported (cpu_attention.h): the fused decode stack (kernels/decode/) calls these directly.
namespace pagoda_cpu {

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                           double logits_soft_cap) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(logits_soft_cap >= 0, "logits_soft_cap must be >= 0 (0: none), got ", logits_soft_cap);
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "query [T, Hq, D] and caches [num_blocks, block_size, Hkv, D] expected");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "pagoda_cpu runs on CPU tensors");
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (fp8_cache || k_cache.scalar_type() == query.scalar_type()),
              "the caches must share the query's dtype, or both be FP8");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  const int64_t T = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t num_blocks = k_cache.size(0), BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "head shapes disagree");
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor lens = seq_lens.to(at::kInt).contiguous();
  const at::Tensor qsl = query_start_loc.to(at::kInt).contiguous();
  std::vector<uint8_t> covered(T, 0);
  const std::vector<Item> items = plan_items(tables, lens, qsl, T, Hkv, Hq / Hkv, BS, num_blocks,
                                             sliding_window, at::get_num_threads(), covered);
  at::Tensor out = at::empty({T, Hq, D}, query.options());
  auto* bytes = static_cast<char*>(out.mutable_data_ptr());
  const int64_t row_bytes = Hq * D * out.element_size();
  for (int64_t r = 0; r < T; ++r) {
    if (!covered[r]) std::memset(bytes + r * row_bytes, 0, row_bytes);  // rows outside every sequence
  }
  const Geometry g{Hq / Hkv, D, (D + 7) / 8 * 8, BS, query.stride(0), query.stride(1), Hq * D,
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
                   static_cast<float>(scale * 1.4426950408889634), sliding_window,
                   static_cast<float>(logits_soft_cap * 1.4426950408889634)};
  if (fp8_cache) {
    run_fp8_cache(g, items, query, k_cache, v_cache, tables, out);
    return out;
  }
  switch (query.scalar_type()) {
    case at::kFloat: run_items<float>(g, items, query, k_cache, v_cache, tables, out); break;
    case at::kBFloat16: run_items<c10::BFloat16>(g, items, query, k_cache, v_cache, tables, out); break;
    case at::kHalf: run_items<c10::Half>(g, items, query, k_cache, v_cache, tables, out); break;
    default: TORCH_CHECK(false, "pagoda_cpu.paged_attention: unsupported dtype ", query.scalar_type());
  }
  return out;
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3),
              "key/value [T, Hkv, D] must match the caches' [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(), "key/value must have the cache dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  const at::Tensor slots_t = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots_t.numel() == key.size(0), "slot_mapping must have one entry per token");
  const int64_t* slots = slots_t.const_data_ptr<int64_t>();
  const int64_t T = key.size(0), H = key.size(1), BS = k_cache.size(1), num_slots = k_cache.size(0) * BS;
  for (int64_t t = 0; t < T; ++t) {  // validate everything before writing anything
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside the cache (", num_slots, " slots)");
  }
  const int64_t es = key.element_size(), row = key.size(2) * es;
  const auto* kp = static_cast<const char*>(key.const_data_ptr());
  const auto* vp = static_cast<const char*>(value.const_data_ptr());
  auto* kc = static_cast<char*>(k_cache.mutable_data_ptr());
  auto* vc = static_cast<char*>(v_cache.mutable_data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;  // padding
    const int64_t block = slots[t] / BS, off = slots[t] % BS;
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(kc + (block * k_cache.stride(0) + off * k_cache.stride(1) + h * k_cache.stride(2)) * es,
                  kp + (t * key.stride(0) + h * key.stride(1)) * es, row);
      std::memcpy(vc + (block * v_cache.stride(0) + off * v_cache.stride(1) + h * v_cache.stride(2)) * es,
                  vp + (t * value.stride(0) + h * value.stride(1)) * es, row);
    }
  }
}

}  // namespace pagoda_cpu

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window=0, float logits_soft_cap=0.0) -> Tensor");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("paged_attention", &pagoda_cpu::paged_attention);
  m.impl("write_kv_cache", &pagoda_cpu::write_kv_cache);
}
