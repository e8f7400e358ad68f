// Paged-attention decode (one query row per sequence) over a paged KV cache, split-K capable.
//
// Cache layout (NHD): k_cache, v_cache [num_blocks, BS, Hkv, D], addressed through int64 element
// strides (block, token, head); the last dim is contiguous and every row starts 16-byte aligned.
//
// paged_decode<T, C, D, BS, G, NT>: grid (Hkv, B, S), NT threads. T is the query/output type
// (fp16/bf16), C the cache element type: T itself, or fp8_e4m3 / fp8_e5m2 (one byte per value).
// One CTA serves the G query heads of one KV head, so each K/V row is read from DRAM once. A token
// row of D elements is covered by D/8 lanes, each loading its 8 elements in one vector (16 bytes
// of T, or 8 bytes of FP8: the same lanes read the same contiguous row, so coalescing is the
// same); every thread keeps UNROLL tokens (K and V) in flight.
// FP8 is decoded on load (fp8.cuh: exact, bit operations + one fp16->fp32 conversion). The
// per-tensor scales never touch an element: k_scale (and the decode's 2^8 unit) is folded into q,
// v_scale into the output. A same-dtype cache ignores them: its code is the plain kernel's.
// Softmax is online, in fp32, in the exp2 domain (scale*log2e is folded into q). Tokens at or
// past seq_len are never loaded (stale slots may hold NaN), nor, with a sliding window (window > 0:
// the row at seq_len - 1 sees positions >= seq_len - window), tokens before the window, whose blocks
// the scheduler may have freed (their table entries are placeholders). Splits then tile the window
// from its first block, so a long context with a short window does not launch empty splits. Each row group keeps its own
// (m, l, acc) state; the CTA merges them through shared memory at the end.
// With soft_cap > 0 (Gemma 2's attn_logit_softcapping) each score s becomes soft_cap * tanh(s / soft_cap)
// before the softmax; in the exp2 domain that is the same map with the cap times log2e.
// S == 1 writes `out`; S > 1 writes fp32 partials (o normalised, lse in natural log) that
// paged_decode_reduce<T, D> merges. An empty split has lse = -inf, o = 0; an empty row gives 0.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "../cuda_elem.cuh"

namespace pagoda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kVec = 8;  // elements per lane per load

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ uint4 load16(const void* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// kVec cache elements of one lane: how they are loaded and decoded. kUnit multiplies every
// decoded value (folded into the scales by the kernel).
template <typename C> struct CacheVec {  // C == T: fp16 / bf16
    typedef uint4 Raw;
    static constexpr bool kFp8 = false;  // the scales are ignored: the kernel is the plain one
    static constexpr float kUnit = 1.0f;
    static __device__ __forceinline__ Raw load(const C* p) { return load16(p); }
    static __device__ __forceinline__ void decode(const Raw& raw, float (&f)[kVec]) { unpack8<C>(raw, f); }
};
template <typename C> struct Fp8CacheVec {
    typedef typename Fp8Format<C>::type Format;
    typedef uint2 Raw;  // 8 codes
    static constexpr bool kFp8 = true;
    static constexpr float kUnit = Format::kDecodeUnit;
    static __device__ __forceinline__ Raw load(const C* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
    static __device__ __forceinline__ void decode(const Raw& raw, float (&f)[kVec]) {
        fp8x4_to_float<Format>(raw.x, f);
        fp8x4_to_float<Format>(raw.y, f + 4);
    }
};
template <> struct CacheVec<fp8_e4m3> : Fp8CacheVec<fp8_e4m3> {};
template <> struct CacheVec<fp8_e5m2> : Fp8CacheVec<fp8_e5m2> {};

// Sum over the LANES lanes that share one token row (lanes are contiguous and LANES-aligned).
template <int LANES>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int off = LANES / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

template <int G> struct Unroll { static constexpr int value = G <= 2 ? 8 : (G <= 4 ? 4 : 2); };

template <typename T, typename C, int D, int BS, int G, int NT>
__global__ void __launch_bounds__(NT) paged_decode(
    T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse,
    const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_ids,
    int max_blocks, int tokens_per_split, float scale,
    long long q_tok_stride, long long q_head_stride,
    long long c_block_stride, long long c_tok_stride, long long c_head_stride,
    long long out_tok_stride, long long out_head_stride, float k_scale, float v_scale, int window,
    float soft_cap) {
    typedef CacheVec<C> Cache;
    constexpr int LANES = D / kVec;      // lanes per token row: 8, 16 or 32
    constexpr int ROWS = NT / LANES;     // token rows per pass == number of partial states
    constexpr int UNROLL = Unroll<G>::value;
    constexpr int CHUNK = ROWS * UNROLL;
    static_assert(D % kVec == 0 && LANES <= 32 && NT % 32 == 0, "unsupported head_dim / NT");

    __shared__ float s_m[ROWS][G];
    __shared__ float s_l[ROWS][G];
    __shared__ __align__(16) float s_o[ROWS][G][D];

    const int kv_head = blockIdx.x, item = blockIdx.y, split = blockIdx.z;
    const int num_splits = gridDim.z, num_heads = gridDim.x * G;
    const int seq = seq_ids != nullptr ? seq_ids[item] : item;
    const int seq_len = seq_lens[seq];
    const long long q_row = query_start_loc[seq];
    const int lo = window > 0 ? max(0, seq_len - window) : 0;  // first visible token
    const int span = lo / BS * BS + split * tokens_per_split;  // this split's block-aligned tokens
    const int start = max(lo, span);
    const int end = min(seq_len, span + tokens_per_split);
    const int row = threadIdx.x / LANES, dim0 = (threadIdx.x % LANES) * kVec;

    // k_scale and the cache's decode unit scale every K element: apply them once, to q; likewise
    // v_scale and the unit for every V element, to the output.
    const float q_mul = Cache::kFp8 ? scale * (k_scale * Cache::kUnit) * kLog2e : scale * kLog2e;
    const float out_mul = Cache::kFp8 ? v_scale * Cache::kUnit : 1.0f;
    const float cap = soft_cap * kLog2e;  // scores are scale * q.k * log2e (k_scale folded in): true ones
    float qf[G][kVec];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const long long off = q_row * q_tok_stride + (long long)(kv_head * G + g) * q_head_stride + dim0;
        unpack8<T>(load16(q + off), qf[g]);
#pragma unroll
        for (int j = 0; j < kVec; ++j) qf[g][j] *= q_mul;
    }
    float m[G], l[G], acc[G][kVec];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[g][j] = 0.f;
    }

    const int* table = block_tables + (long long)seq * max_blocks;
    const long long head_off = (long long)kv_head * c_head_stride + dim0;
    // The loop bound is uniform across the CTA, so every lane reaches every shuffle.
    for (int base = start; base < end; base += CHUNK) {
        typename Cache::Raw kr[UNROLL], vr[UNROLL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int tok = base + u * ROWS + row;
            valid[u] = tok < end;
            kr[u] = typename Cache::Raw{};  // zero bits: 0.0 in every cache type
            vr[u] = kr[u];
            if (valid[u]) {  // int64: block_id * block_stride overflows int32 on large caches
                const long long off = (long long)table[tok / BS] * c_block_stride
                                      + (long long)(tok % BS) * c_tok_stride + head_off;
                kr[u] = Cache::load(k_cache + off);
                vr[u] = Cache::load(v_cache + off);
            }
        }
        float s[G][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[kVec];
            Cache::decode(kr[u], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < kVec; ++j) dot = fmaf(qf[g][j], kf[j], dot);
                s[g][u] = dot;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float chunk_max = neg_inf();
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float total = row_sum<LANES>(s[g][u]);  // every lane shuffles, masked or not
                if (cap > 0.f) total = cap * tanhf(total / cap);
                s[g][u] = valid[u] ? total : neg_inf();
                chunk_max = fmaxf(chunk_max, s[g][u]);
            }
            const float m_new = fmaxf(m[g], chunk_max);
            // All-masked so far: subtract 0 so exp2(-inf - 0) = 0 instead of exp2(NaN).
            const float m_use = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = exp2f(m[g] - m_use);
            l[g] *= alpha;
#pragma unroll
            for (int j = 0; j < kVec; ++j) acc[g][j] *= alpha;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                s[g][u] = exp2f(s[g][u] - m_use);  // now p
                l[g] += s[g][u];
            }
            m[g] = m_new;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float vf[kVec];
            Cache::decode(vr[u], vf);  // zeros when masked, and p == 0 there too
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int j = 0; j < kVec; ++j) acc[g][j] = fmaf(s[g][u], vf[j], acc[g][j]);
            }
        }
    }

    // Cross-row merge. Lanes of one row hold identical (m, l) because scores were row-summed.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (dim0 == 0) {
            s_m[row][g] = m[g];
            s_l[row][g] = l[g];
        }
        float4* dst = reinterpret_cast<float4*>(&s_o[row][g][dim0]);
        dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += NT) {
        const int g = idx / D, d = idx % D;
        float m_max = neg_inf();
#pragma unroll
        for (int r = 0; r < ROWS; ++r) m_max = fmaxf(m_max, s_m[r][g]);
        const float m_use = m_max == neg_inf() ? 0.f : m_max;
        float l_sum = 0.f, o_sum = 0.f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float w = exp2f(s_m[r][g] - m_use);
            l_sum = fmaf(s_l[r][g], w, l_sum);
            o_sum = fmaf(s_o[r][g][d], w, o_sum);
        }
        const float o = l_sum > 0.f ? o_sum / l_sum * out_mul : 0.f;
        const int head = kv_head * G + g;
        if (num_splits == 1) {
            out[q_row * out_tok_stride + (long long)head * out_head_stride + d] = Elem<T>::from_float(o);
        } else {
            const long long part = ((long long)item * num_heads + head) * num_splits + split;
            part_o[part * D + d] = o;
            if (d == 0) part_lse[part] = l_sum > 0.f ? (m_max + __log2f(l_sum)) * kLn2 : neg_inf();
        }
    }
}

// grid (Hq, B), D threads: out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse).
// A -inf partial weighs 0 and is never read; a row whose partials are all empty writes 0.
template <typename T, int D>
__global__ void __launch_bounds__(D) paged_decode_reduce(
    T* __restrict__ out, const float* __restrict__ part_o, const float* __restrict__ part_lse,
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_ids, int num_splits,
    long long out_tok_stride, long long out_head_stride) {
    const int head = blockIdx.x, item = blockIdx.y, d = threadIdx.x;
    const int seq = seq_ids != nullptr ? seq_ids[item] : item;
    const long long part0 = ((long long)item * gridDim.x + head) * num_splits;
    float lse_max = neg_inf();
    for (int s = 0; s < num_splits; ++s) lse_max = fmaxf(lse_max, part_lse[part0 + s]);
    float w_sum = 0.f, o_sum = 0.f;
    if (lse_max != neg_inf()) {
        for (int s = 0; s < num_splits; ++s) {
            const float lse = part_lse[part0 + s];
            if (lse == neg_inf()) continue;
            const float w = __expf(lse - lse_max);
            w_sum += w;
            o_sum = fmaf(w, part_o[(part0 + s) * D + d], o_sum);
        }
    }
    const float o = w_sum > 0.f ? o_sum / w_sum : 0.f;
    const long long q_row = query_start_loc[seq];
    out[q_row * out_tok_stride + (long long)head * out_head_stride + d] = Elem<T>::from_float(o);
}

}  // namespace pagoda
