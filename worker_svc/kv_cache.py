"""The physical paged KV cache: every layer's K and V blocks in one tensor, and how many blocks fit.

Block ids always come from the scheduler; this module only owns the memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.contract.step import BlockCopy

DEFAULT_CPU_CACHE_BYTES = 1 << 30  # 1 GiB when kv_cache_memory_bytes is not set (or more: cpu_num_blocks)


@dataclass(frozen=True, slots=True)
class CacheShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def storage_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]: the one layout
        of the device cache and of the host swap pool, so a block copies between them as is."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size


class KVCache:
    """storage: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

    `layers[i]` is (k_cache, v_cache) of layer i, each a contiguous view
    [num_blocks, block_size, num_kv_heads, head_dim] of the one storage tensor, so a block copy
    over every layer is a single indexed op.
    """

    def __init__(self, shape: CacheShape, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.storage = torch.zeros(shape.storage_shape(num_blocks), dtype=shape.dtype, device=device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.storage[i, 0], self.storage[i, 1]) for i in range(shape.num_layers)]

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy-on-write: every layer's K and V of block src[i] into block dst[i]."""
        if not src:
            return
        device = self.storage.device
        src_index = torch.tensor(list(src), dtype=torch.long, device=device)
        dst_index = torch.tensor(list(dst), dtype=torch.long, device=device)
        # [L, 2, num_copies, block_size, H, D]; gathered first, so a dst that is also a src is safe.
        self.storage[:, :, dst_index] = self.storage[:, :, src_index]


# Block copies run on a same-size integer view: index_copy_ has no CPU kernel for the FP8 dtypes.
_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as a same-size integer tensor (block copies and the disk tier's files)."""
    return tensor.view(_RAW_DTYPES[tensor.element_size()])


_raw = raw_view


class HostKVPool:
    """The swap space (--swap-space) and, after its blocks, the prefix cache's host tier
    (--kv-offloading-size): KV blocks in host memory, laid out as a KVCache's
    storage [num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim], page-locked when
    the device cache is on CUDA so the copies are DMA transfers. Block ids come from the scheduler.
    On a CPU worker the "device" cache is host memory too: a copy is a memcpy within the worker
    process (an indexed gather and scatter between two CPU tensors), still worth it against a
    recompute of the block's tokens through every layer.

    A swap moves a batch of blocks with one gather and one scatter per layer: the staging tensor
    is one layer's blocks, not all layers' (the device may be nearly full when it preempts).
    """

    def __init__(self, shape: CacheShape, num_blocks: int, pin_memory: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host pool needs at least one block, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        # Never zeroed: a host block is always written by a swap-out before a swap-in reads it.
        self.storage = torch.empty(shape.storage_shape(num_blocks), dtype=shape.dtype, device="cpu",
                                   pin_memory=pin_memory)

    def apply(self, cache: KVCache, swap_out: Sequence[BlockCopy], swap_in: Sequence[BlockCopy]) -> None:
        """A plan's swaps, in the plan's order: swap-outs (device -> host), then swap-ins."""
        if swap_out:
            self.swap_out(cache, [c.src for c in swap_out], [c.dst for c in swap_out])
        if swap_in:
            self.swap_in(cache, [c.src for c in swap_in], [c.dst for c in swap_in])

    def swap_out(self, cache: KVCache, src: Sequence[int], dst: Sequence[int]) -> None:
        """Device block src[i] -> host block dst[i], every layer's K and V."""
        device_raw, host_raw = _raw(cache.storage), _raw(self.storage)
        src_index = torch.tensor(list(src), dtype=torch.long, device=cache.storage.device)
        dst_index = torch.tensor(list(dst), dtype=torch.long)
        for layer in range(self.shape.num_layers):  # [2, n, block_size, H, D] staged per layer
            host_raw[layer].index_copy_(1, dst_index, device_raw[layer].index_select(1, src_index).cpu())

    def swap_in(self, cache: KVCache, src: Sequence[int], dst: Sequence[int]) -> None:
        """Host block src[i] -> device block dst[i], every layer's K and V."""
        device = cache.storage.device
        device_raw, host_raw = _raw(cache.storage), _raw(self.storage)
        src_index = torch.tensor(list(src), dtype=torch.long)
        dst_index = torch.tensor(list(dst), dtype=torch.long, device=device)
        for layer in range(self.shape.num_layers):
            device_raw[layer].index_copy_(1, dst_index, host_raw[layer].index_select(1, src_index).to(device))


def num_cpu_blocks(swap_space_gib: float, shape: CacheShape) -> int:
    """Host blocks in `swap_space_gib` GiB (per rank under tensor parallelism, as vLLM's)."""
    return num_blocks_for_budget(int(swap_space_gib * (1 << 30)), shape)


def num_blocks_for_budget(budget_bytes: int, shape: CacheShape) -> int:
    return max(0, budget_bytes // shape.bytes_per_block)


def cpu_num_blocks(kv_cache_memory_bytes: int | None, shape: CacheShape, max_model_len: int = 0,
                   available_bytes: int | None = None) -> int:
    """A given budget as is; by default 1 GiB, or one whole max_model_len sequence where that is
    more (Qwen2.5-1.5B's 32k context is 1.75 GiB in fp32): an agent's request without max_tokens
    (Codex's Responses request) reserves the context's room, which 1 GiB would refuse. Never more
    than half the host's available memory (`available_bytes`, read from the OS by default)."""
    if kv_cache_memory_bytes:
        return num_blocks_for_budget(kv_cache_memory_bytes, shape)
    default = num_blocks_for_budget(DEFAULT_CPU_CACHE_BYTES, shape)
    one_sequence = -(-max_model_len // shape.block_size)
    if one_sequence <= default:
        return default
    if available_bytes is None:
        available_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(default, min(one_sequence, num_blocks_for_budget(available_bytes // 2, shape)))


def cuda_num_blocks(device: torch.device, gpu_memory_utilization: float, shape: CacheShape,
                    peak_allocated_bytes: int) -> int:
    """Blocks that fit in utilization * total memory, minus the profiled peak (weights included)
    and the memory other processes / non-torch allocations hold."""
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = int(total * gpu_memory_utilization) - peak_allocated_bytes - max(0, non_torch)
    return num_blocks_for_budget(budget, shape)
