"""The prefix cache's host tier on the real worker (tiny model, CPU, fp32): multi-turn sessions in a
device pool too small to keep them, with and without `kv_offloading_size`. Greedy tokens are
identical, later turns hit prefixes that were evicted from the device (loaded back from the host,
counted as cached tokens), fewer prefill tokens are computed, and the scheduler's invariant (device
pool, host pool, host tier) holds after every step."""

from __future__ import annotations

import random

from pagoda import LLM, SamplingParams
from tests.worker.test_swap_worker import check_invariants_every_step


def run_sessions(model_dir: str, device: str = "cpu", **kwargs):
    """4 sessions x 3 turns, one request at a time: each turn's prompt is the session's history
    (its earlier prompts and replies) plus a new user message of 20-40 tokens."""
    llm = LLM(model=model_dir, dtype="float32", device=device, seed=0, block_size=16,
              num_gpu_blocks_override=14, **kwargs)
    check_invariants_every_step(llm)
    rng = random.Random(11)
    histories = [[rng.randrange(10, 2048) for _ in range(40)] for _ in range(4)]
    replies, cached = [], []
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for turn in range(3):
        for history in histories:
            (out,) = llm.generate([{"prompt_token_ids": list(history)}], params, use_tqdm=False)
            reply = list(out.outputs[0].token_ids)
            replies.append(reply)
            cached.append(out.num_cached_tokens if turn else None)
            history += reply + [rng.randrange(10, 2048) for _ in range(rng.randint(20, 40))]
    return replies, cached, llm.stats()


def test_host_tier_is_token_identical_and_serves_evicted_prefixes(tiny_model_dir: str) -> None:
    plain, plain_cached, plain_stats = run_sessions(tiny_model_dir)
    # 64 KiB a block (16 slots, tiny model): 4 MiB of host tier = 64 blocks, room for every session.
    tiered, tiered_cached, stats = run_sessions(tiny_model_dir, kv_offloading_size=4 / 1024)
    assert plain_stats.blocks_offloaded == 0
    assert tiered == plain
    assert stats.num_offload_blocks == 64 and stats.num_cpu_blocks == 0
    assert stats.blocks_offloaded > 0 and stats.blocks_loaded > 0
    # 14 device blocks hold about one session: without the tier, turn 3 finds nothing. With it
    # every later turn hits its whole registered history: turn 2 the first 2 blocks (40 prompt +
    # 7 computed reply tokens), turn 3 the first 5.
    assert plain_cached[4:] == [32, 32, 16, 0, 0, 0, 0, 0]
    assert tiered_cached[4:] == [32] * 4 + [80] * 4
    assert (stats.prefill_tokens_computed, plain_stats.prefill_tokens_computed) == (523, 891)
