// KV-cache write: copies this step's key/value rows into their cache slots in one pass.
//
// grid (num_tokens), any block size (host uses min(Hkv*D/VEC, 512)). Every copy is one 16-byte
// vector: head_dim is a multiple of VEC and every row starts 16-byte aligned (host-checked).
// slot = block_id * block_size + offset; slot < 0 marks padding and is skipped.
// Strides are int64 elements so key/value may be slices of a fused qkv tensor and the cache may
// be NHD [NB, BS, Hkv, D] or HND [NB, Hkv, BS, D].
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace pagoda {

template <typename T>
__global__ void kv_cache_write(
    const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ k_cache,
    T* __restrict__ v_cache, const long long* __restrict__ slot_mapping,
    int num_kv_heads, int head_dim, int block_size,
    long long key_tok_stride, long long key_head_stride,
    long long val_tok_stride, long long val_head_stride,
    long long c_block_stride, long long c_tok_stride, long long c_head_stride) {
    constexpr int VEC = 16 / sizeof(T);
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;  // padding token: its cache slot is left untouched
    const long long cache_row = (slot / block_size) * c_block_stride + (slot % block_size) * c_tok_stride;
    const int vecs_per_head = head_dim / VEC;
    for (int i = threadIdx.x; i < num_kv_heads * vecs_per_head; i += blockDim.x) {
        const int head = i / vecs_per_head;
        const int dim = (i % vecs_per_head) * VEC;
        const long long dst = cache_row + head * c_head_stride + dim;
        const uint4 k = *reinterpret_cast<const uint4*>(key + token * key_tok_stride + head * key_head_stride + dim);
        const uint4 v = *reinterpret_cast<const uint4*>(value + token * val_tok_stride + head * val_head_stride + dim);
        *reinterpret_cast<uint4*>(k_cache + dst) = k;
        *reinterpret_cast<uint4*>(v_cache + dst) = v;
    }
}

}  // namespace pagoda
