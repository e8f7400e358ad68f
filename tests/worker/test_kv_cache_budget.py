"""The CPU KV pool's default size: 1 GiB, or one whole max_model_len sequence where that is more."""

from __future__ import annotations

import torch

from worker_svc.kv_cache import DEFAULT_CPU_CACHE_BYTES, CacheShape, cpu_num_blocks

# Qwen2.5-Coder-1.5B in fp32: 57,344 bytes a token, so 1 GiB holds 18,724 tokens (1,170 blocks),
# less than its 32,768-token context: Codex's request (no max_output_tokens) needs 2,048 blocks.
QWEN_1_5B = CacheShape(num_layers=28, block_size=16, num_kv_heads=2, head_dim=128, dtype=torch.float32)
GIB = 1 << 30


def test_a_long_context_gets_room_for_one_whole_sequence():
    assert cpu_num_blocks(None, QWEN_1_5B, max_model_len=32768, available_bytes=16 * GIB) == 2048


def test_a_short_context_keeps_the_1_gib_default():
    assert cpu_num_blocks(None, QWEN_1_5B, max_model_len=8192, available_bytes=16 * GIB) == \
        DEFAULT_CPU_CACHE_BYTES // QWEN_1_5B.bytes_per_block == 1170


def test_never_more_than_half_the_available_memory_nor_less_than_the_default():
    half_of_3_gib = (3 * GIB // 2) // QWEN_1_5B.bytes_per_block
    assert cpu_num_blocks(None, QWEN_1_5B, max_model_len=131072, available_bytes=3 * GIB) == half_of_3_gib
    assert cpu_num_blocks(None, QWEN_1_5B, max_model_len=131072, available_bytes=GIB) == 1170


def test_a_given_budget_is_kept_as_is():
    assert cpu_num_blocks(GIB // 2, QWEN_1_5B, max_model_len=32768) == 585
