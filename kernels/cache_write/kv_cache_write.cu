// KV-cache write: copies this step's key/value rows into their cache slots in one pass.
//
// kv_cache_write<T, C>: T is the key/value type (fp16/bf16), C the cache element type: T (a plain
// copy) or fp8_e4m3 / fp8_e5m2 (encoded on the way: value * inv_scale, rounded to nearest even
// exactly as torch's `.to(float8)` does; fp8.cuh). The scales are ignored when C == T.
// grid (num_tokens), any block size (host uses min(Hkv*D/VEC, 512)). Every thread moves VEC
// elements: one 16-byte load of T, one 16-byte (T) or 8-byte (FP8) store. head_dim is a multiple
// of VEC and every row starts 16-byte aligned (host-checked).
// slot = block_id * block_size + offset; slot < 0 marks padding and is skipped.
// Strides are int64 elements so key/value may be slices of a fused qkv tensor and the cache may
// be NHD [NB, BS, Hkv, D] or HND [NB, Hkv, BS, D].
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "../cuda_elem.cuh"

namespace pagoda {

// VEC = 8 elements of T (one uint4) -> the cache.
template <typename T, typename C> struct CacheStore {  // C == T: a copy
    static __device__ __forceinline__ void store(C* dst, const uint4& src, float) {
        *reinterpret_cast<uint4*>(dst) = src;
    }
};
template <typename T, typename C> struct Fp8CacheStore {
    typedef typename Fp8Format<C>::type Format;
    static __device__ __forceinline__ unsigned encode4(const float* f, float inv_scale) {
        unsigned w = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) w |= Format::from_float(fp8::scaled_for_encode(f[j], inv_scale)) << (8 * j);
        return w;
    }
    static __device__ __forceinline__ void store(C* dst, const uint4& src, float inv_scale) {
        float f[8];
        unpack8<T>(src, f);
        *reinterpret_cast<uint2*>(dst) = make_uint2(encode4(f, inv_scale), encode4(f + 4, inv_scale));
    }
};
template <typename T> struct CacheStore<T, fp8_e4m3> : Fp8CacheStore<T, fp8_e4m3> {};
template <typename T> struct CacheStore<T, fp8_e5m2> : Fp8CacheStore<T, fp8_e5m2> {};

template <typename T, typename C>
__global__ void kv_cache_write(
    const T* __restrict__ key, const T* __restrict__ value, C* __restrict__ k_cache,
    C* __restrict__ v_cache, const long long* __restrict__ slot_mapping,
    int num_kv_heads, int head_dim, int block_size,
    long long key_tok_stride, long long key_head_stride,
    long long val_tok_stride, long long val_head_stride,
    long long c_block_stride, long long c_tok_stride, long long c_head_stride,
    float k_inv_scale, float v_inv_scale) {
    constexpr int VEC = 16 / sizeof(T);
    static_assert(VEC == 8, "T must be a 2-byte type");
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
        CacheStore<T, C>::store(k_cache + dst, k, k_inv_scale);
        CacheStore<T, C>::store(v_cache + dst, v, v_inv_scale);
    }
}

}  // namespace pagoda
