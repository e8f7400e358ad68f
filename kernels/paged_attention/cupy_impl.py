"""CuPy RawKernel backend: NVRTC-compiled CUDA launched on torch's current stream with raw pointers.

Decode rows (q_len == 1) run paged_decode.cu (split-K + reduce when the grid is too small to fill
the GPU). Prefill rows (q_len > 1: prompts, chunks over a cached prefix) run the torch reference
(SDPA with a lower-right causal mask) until the varlen kernel lands. Kernels are compiled per
(dtype, cache dtype, head_dim, block_size, group) by `warmup`, before any step or CUDA-graph capture.
FP8 caches (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2) are encoded by the cache write and decoded
on load by the decode kernel, with per-tensor scales k_scale / v_scale (vLLM's default 1.0: the
cache holds value / scale). Imported only when backend "cupy" is asked for (kernels.get_backend).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from kernels import nvrtc
from kernels.cache_write import check_write_args, launch_kv_cache_write
from kernels.kv_cache_dtype import is_fp8
from kernels.splitk_mirror import choose_num_splits, tokens_per_split

log = structlog.get_logger(__name__)

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FP8_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def cache_ctype(dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """The CUDA type of a cache element: the activations' own, or an FP8 tag type."""
    if cache_dtype in _FP8_NAMES:
        return nvrtc.FP8_CTYPES[_FP8_NAMES[cache_dtype]]
    if cache_dtype != dtype:
        raise ValueError(f"cupy backend: a {cache_dtype} cache under {dtype} activations is not supported "
                         "(the cache dtype is the model's, or FP8)")
    return nvrtc.CTYPES[_DTYPE_NAMES[dtype]]


@dataclass(slots=True, frozen=True)
class KernelShape:
    dtype: torch.dtype
    head_dim: int
    block_size: int
    group_size: int
    cache_dtype: torch.dtype | None = None  # None: the same as dtype

    @property
    def ctype(self) -> str:
        return nvrtc.CTYPES[_DTYPE_NAMES[self.dtype]]

    @property
    def cache_ctype(self) -> str:
        return cache_ctype(self.dtype, self.cache_dtype or self.dtype)

    def validate(self) -> None:
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"cupy backend supports float16/bfloat16, not {self.dtype}")
        self.cache_ctype  # noqa: B018 -- raises for an unsupported cache dtype
        for what, value, allowed in (("head_dim", self.head_dim, nvrtc.HEAD_DIMS),
                                     ("block_size", self.block_size, nvrtc.BLOCK_SIZES),
                                     ("GQA group size", self.group_size, nvrtc.GROUP_SIZES)):
            if value not in allowed:
                raise ValueError(f"cupy backend: {what} {value} not compiled (supported: {allowed})")


class _TorchStreamHandle:
    """CUDA stream protocol object for CuPy's Stream.from_external (CuPy >= 14)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _cupy_stream(device: torch.device):
    # Sampled on every call: a cached stream breaks graph capture and stream switches.
    import cupy

    ptr = torch.cuda.current_stream(device).cuda_stream
    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_TorchStreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device.index)


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    elems = 16 // tensor.element_size()
    if tensor.stride(-1) != 1 or any(s % elems for s in tensor.stride()[:-1]) or tensor.data_ptr() % 16:
        raise ValueError(f"{name}: rows must be contiguous and 16-byte aligned")


class CupyBackend:
    name = "cupy"

    def __init__(self, num_splits: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self.num_splits = num_splits  # None: FA2 heuristic; an int forces split-K (tests, benchmarks)
        # FP8 per-tensor scales (the cache holds value / scale); unused by same-dtype caches.
        # 1.0 is vLLM's default; Pagoda has no --calculate-kv-scales or checkpoint scales yet.
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"k_scale and v_scale must be positive, got {k_scale}, {v_scale}")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self._modules = nvrtc.ModuleCache()
        self._sm_counts: dict[int, int] = {}

    # -- compilation -------------------------------------------------------------------------
    def warmup(self, shapes: Iterable[KernelShape]) -> None:
        """Compile every kernel these shapes need; call before serving and before graph capture."""
        for shape in shapes:
            self._decode_kernels(shape)
            self._cache_write_kernel(shape.dtype, shape.cache_dtype or shape.dtype)

    def _decode_kernels(self, shape: KernelShape) -> tuple[object, object]:
        shape.validate()
        decode = nvrtc.decode_kernel_name(shape.ctype, shape.head_dim, shape.block_size, shape.group_size,
                                          shape.cache_ctype)
        reduce = nvrtc.reduce_kernel_name(shape.ctype, shape.head_dim)
        key = (decode, reduce)  # not the shape: cache_dtype None and == dtype are the same kernels
        if key not in self._modules:
            log.info("kernel_compiling", kernel="paged_decode", shape=str(shape))
        kernels = self._modules.kernels(key, nvrtc.DECODE_SOURCE, [decode, reduce])
        return kernels[decode], kernels[reduce]

    def _cache_write_kernel(self, dtype: torch.dtype, cache_dtype: torch.dtype):
        shape = KernelShape(dtype, 64, 16, 1, cache_dtype)
        shape.validate()
        name = nvrtc.cache_write_kernel_name(shape.ctype, shape.cache_ctype)
        return self._modules.kernels(("cache_write", name), nvrtc.CACHE_WRITE_SOURCE, [name])[name]

    def _scales(self, cache_dtype: torch.dtype) -> tuple[float, float]:
        return (self.k_scale, self.v_scale) if is_fp8(cache_dtype) else (1.0, 1.0)

    def _sm_count(self, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sm_counts:
            self._sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._sm_counts[index]

    # -- AttentionBackend --------------------------------------------------------------------
    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        import cupy

        check_write_args(key, value, k_cache, v_cache, slot_mapping)
        kernel = self._cache_write_kernel(key.dtype, k_cache.dtype)
        with cupy.cuda.Device(k_cache.device.index):
            launch_kv_cache_write(kernel, key, value, k_cache, v_cache, slot_mapping,
                                  _cupy_stream(k_cache.device), *self._scales(k_cache.dtype))

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None) -> torch.Tensor:
        # query [T, Hq, D] -> out [T, Hq, D]
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        num_seqs = seq_lens.shape[0]
        if max_seq_len > block_tables.shape[1] * k_cache.shape[1]:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table's capacity")
        if max_query_len <= 1 and query.shape[0] == num_seqs:
            # Pure decode: row i is sequence i. No host sync on this path.
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            self._decode(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                         max_seq_len, out, None, num_seqs, sliding_window, logits_soft_cap)
            return out
        return self._mixed(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                           max_query_len, max_seq_len, sliding_window, logits_soft_cap)

    def _mixed(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
               max_query_len, max_seq_len, sliding_window, logits_soft_cap=None) -> torch.Tensor:
        starts = query_start_loc.tolist()  # host sync: the torch prefill path needs lengths anyway
        q_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        decode_ids = [i for i, n in enumerate(q_lens) if n == 1]
        prefill_ids = [i for i, n in enumerate(q_lens) if n > 1]
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)  # padding rows: 0
        if decode_ids:
            seq_ids = torch.tensor(decode_ids, dtype=torch.int32).to(query.device, non_blocking=True)
            self._decode(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                         max_seq_len, out, seq_ids, len(decode_ids), sliding_window, logits_soft_cap)
        if prefill_ids:
            from kernels.paged_attention.reference import TorchBackend

            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in prefill_ids]).to(query.device)
            sub_starts = np.concatenate([[0], np.cumsum([q_lens[i] for i in prefill_ids])])
            ids = torch.tensor(prefill_ids, device=query.device)
            # The reference decodes an FP8 cache on gather without scales: k_scale scales every
            # score (fold it into the softmax scale), v_scale every output.
            k_scale, v_scale = self._scales(k_cache.dtype)
            prefill = TorchBackend().paged_attention(
                query[rows], k_cache, v_cache, block_tables[ids], seq_lens[ids],
                torch.tensor(sub_starts, dtype=torch.int32, device=query.device), scale * k_scale,
                max_query_len, max_seq_len, sliding_window, logits_soft_cap)
            out[rows] = prefill if v_scale == 1.0 else (prefill.float() * v_scale).to(prefill.dtype)
        return out

    def _decode(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                max_seq_len, out, seq_ids, num_items, sliding_window=None, logits_soft_cap=None) -> None:
        import cupy

        num_heads, head_dim = query.shape[1], query.shape[2]
        _, block_size, num_kv_heads, _ = k_cache.shape
        shape = KernelShape(query.dtype, head_dim, block_size, num_heads // num_kv_heads, k_cache.dtype)
        if (num_heads % num_kv_heads or v_cache.dtype != k_cache.dtype
                or k_cache.stride() != v_cache.stride()):
            raise ValueError("query/cache mismatch: heads, K/V dtypes or K/V strides")
        for name, tensor in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
            _check_rows(name, tensor)
        for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens),
                             ("query_start_loc", query_start_loc)):
            if tensor.dtype != torch.int32 or not tensor.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int32 tensor")
        decode, reduce = self._decode_kernels(shape)
        # Under a window the kernel reads at most window tokens, from the window's first block on:
        # split that span, not the whole context.
        span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_size)
        splits = self.num_splits or choose_num_splits(num_items, num_kv_heads, span,
                                                      self._sm_count(query.device))
        part_o = part_lse = None
        if splits > 1:
            part_o = torch.empty(num_items, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
            part_lse = torch.empty(num_items, num_heads, splits, dtype=torch.float32, device=query.device)
        seq_ids_ptr = seq_ids.data_ptr() if seq_ids is not None else 0
        args = (
            out.data_ptr(), part_o.data_ptr() if part_o is not None else 0,
            part_lse.data_ptr() if part_lse is not None else 0,
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            seq_lens.data_ptr(), query_start_loc.data_ptr(), seq_ids_ptr,
            np.int32(block_tables.shape[1]), np.int32(tokens_per_split(span, block_size, splits)),
            np.float32(scale), np.int64(query.stride(0)), np.int64(query.stride(1)),
            np.int64(k_cache.stride(0)), np.int64(k_cache.stride(1)), np.int64(k_cache.stride(2)),
            np.int64(out.stride(0)), np.int64(out.stride(1)),
            *(np.float32(s) for s in self._scales(k_cache.dtype)), np.int32(sliding_window or 0),
            np.float32(logits_soft_cap or 0.0),  # 0: no cap
        )
        with cupy.cuda.Device(query.device.index):
            stream = _cupy_stream(query.device)
            decode((num_kv_heads, num_items, splits), (nvrtc.DECODE_THREADS,), args, stream=stream)
            if splits > 1:
                reduce_args = (out.data_ptr(), part_o.data_ptr(), part_lse.data_ptr(),
                               query_start_loc.data_ptr(), seq_ids_ptr, np.int32(splits),
                               np.int64(out.stride(0)), np.int64(out.stride(1)))
                reduce((num_heads, num_items), (head_dim,), reduce_args, stream=stream)
