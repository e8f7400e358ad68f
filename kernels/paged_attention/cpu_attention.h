// The compiled paged-attention entry points of cpu_attention.cpp, for other C++ sources of the
// same extension (the fused decode stack) to call without going through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

namespace pagoda_cpu {

// query [T, Hq, D] (head_dim contiguous, any row stride) -> [T, Hq, D]; see cpu_attention.cpp.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                           double logits_soft_cap);

// key, value [T, Hkv, D] in the caches' dtype -> the slots of slot_mapping (-1: skipped).
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping);

}  // namespace pagoda_cpu
