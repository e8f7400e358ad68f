"""Swap preemption at tensor parallelism 2 (CPU, gloo): each rank swaps its own shard of KV heads
to its own host pool under the same block ids, and the tokens are TP=1's. A module of its own:
test_tp_parity.py keeps a TP=2 group open for its whole module, and a process joins one group."""

from __future__ import annotations

import pytest

from pagoda import LLM
from tests.worker.test_tp_parity import ENGINE, completions, run


@pytest.mark.slow
def test_tp2_swap_preemption_gives_tp1_tokens(tiny_model_dir: str) -> None:
    with LLM(model=tiny_model_dir, tensor_parallel_size=1, **ENGINE) as llm:
        want, tp1_stats = run(llm)
    # A rank's block at block size 8 holds 1 KV head: 16 KiB, so 1 MiB of swap space is 64 blocks.
    with LLM(model=tiny_model_dir, tensor_parallel_size=2, preemption_mode="swap", swap_space=1 / 1024,
             **ENGINE) as llm:
        outputs, stats = run(llm)
    assert tp1_stats.num_preemptions > 0 and tp1_stats.num_swap_preemptions == 0
    assert stats.num_cpu_blocks == 64 and stats.num_swap_preemptions > 0 and stats.blocks_swapped_in > 0
    assert completions(outputs) == completions(want)
