"""Swap preemption on the real worker: the host pool's copies (every layer, FP8 too, in the plan's
order), swap plans validated before anything changes, a request swapped out and back in that
continues with the very tokens it would have produced, and the acceptance run through `LLM`:
`preemption_mode="swap"` is token-identical to recompute and to an unconstrained pool, with swaps
counted in both directions and fewer prefill tokens computed, the block invariant holding for the
device and the host pool after every step."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.contract.errors import PlanError
from pagoda.contract.ids import RequestId
from pagoda.contract.step import BlockCopy, NewRequestData, StepPlan, TableUpdate
from worker_svc.config import WorkerConfig
from worker_svc.kv_cache import CacheShape, HostKVPool, KVCache
from worker_svc.model_runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PROMPT = [1, 17, 33, 49, 65, 81, 97]


# -- the host pool --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_swap_out_and_in_copy_every_layer_in_plan_order(dtype: torch.dtype) -> None:
    shape = CacheShape(num_layers=3, block_size=2, num_kv_heads=2, head_dim=4, dtype=dtype)
    cache, host = KVCache(shape, 6, torch.device("cpu")), HostKVPool(shape, 4, pin_memory=False)
    cache.storage.copy_(torch.randn(cache.storage.shape).to(dtype))
    host.storage.copy_(torch.randn(host.storage.shape).to(dtype))
    device_before, host_before = cache.storage.clone(), host.storage.clone()
    # Device block 2 is swapped out and, in the same plan, receives host block 3: the swap-out
    # must read it first. Device blocks 4 -> host 0.
    host.apply(cache, [BlockCopy(2, 1), BlockCopy(4, 0)], [BlockCopy(3, 2)])
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731  (NaN-safe)
    assert same(host.storage[:, :, 1], device_before[:, :, 2]) and same(host.storage[:, :, 0], device_before[:, :, 4])
    assert same(cache.storage[:, :, 2], host_before[:, :, 3])
    assert same(host.storage[:, :, [2, 3]], host_before[:, :, [2, 3]])
    assert same(cache.storage[:, :, [0, 1, 3, 4, 5]], device_before[:, :, [0, 1, 3, 4, 5]])


# -- the model runner -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner(tiny_model_dir: str) -> ModelRunner:
    # The tiny model: 4 layers x 2 (K, V) x 4 slots x 2 heads x 64 x 4 bytes = 16 KiB a block.
    config = WorkerConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                          num_gpu_blocks_override=NUM_BLOCKS, swap_space=8 * 16 / (1 << 20))
    runner = ModelRunner(config, max_num_batched_tokens=64)
    assert runner.initialize().num_cpu_blocks == 8
    return runner


class Steps:
    def __init__(self, runner: ModelRunner) -> None:
        runner.reset()
        self.runner, self.next_id = runner, 0

    def run(self, **fields):
        self.next_id += 1
        return self.runner.execute(StepPlan(step_id=self.next_id, **fields))


def check_invariants_every_step(llm) -> None:
    """Wrap the LLM's scheduler.update so that the block accounting (device and host pools) is
    checked after every step's results are applied."""
    update = llm.scheduler.update

    def checked_update(result):
        deltas = update(result)
        llm.scheduler.check_invariants()
        return deltas

    llm.scheduler.update = checked_update


def new(rid: str, tokens: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(RequestId(rid), list(tokens), len(PROMPT), list(blocks), computed,
                          len(tokens) - computed, GREEDY)


def decode(steps: Steps, rid: str, num_steps: int, first_block: int) -> list[int]:
    """Decode num_steps tokens; the table grows by one block (first_block, +1...) when needed."""
    tokens = []
    for _ in range(num_steps):
        state = steps.runner.requests[RequestId(rid)]
        position = state.num_computed_tokens
        updates = []
        if position == len(state.block_ids) * BLOCK_SIZE:
            updates = [TableUpdate(RequestId(rid), len(state.block_ids), [first_block])]
            first_block += 1
        tokens += steps.run(table_updates=updates).token_ids
    return tokens


def test_swapped_out_and_in_request_continues_with_the_same_tokens(runner: ModelRunner) -> None:
    steps = Steps(runner)
    first = steps.run(new_requests=[new("a", PROMPT, [0, 1])]).token_ids
    want = first + decode(steps, "a", 8, first_block=2)  # positions 7..14: blocks 0, 1, 2, 3

    steps = Steps(runner)
    tokens = steps.run(new_requests=[new("a", PROMPT, [0, 1])]).token_ids + decode(steps, "a", 3, 2)
    state = runner.requests[RequestId("a")]
    history, computed = list(state.token_ids), state.num_computed_tokens  # 11 tokens, 10 computed
    assert (len(history), computed, state.block_ids) == (11, 10, [0, 1, 2])
    # Preempted with a swap-out of its 3 blocks to host blocks 5, 6, 7; then the device blocks are
    # scribbled over (reused by others), and it resumes in other device blocks from the host.
    steps.run(preempted_ids=[RequestId("a")],
              swap_out=[BlockCopy(0, 5), BlockCopy(1, 6), BlockCopy(2, 7)])
    runner.kv_cache.storage[:, :, :3] = 0.0
    result = steps.run(new_requests=[new("a", history, [9, 10, 11], computed=computed)],
                       swap_in=[BlockCopy(5, 9), BlockCopy(6, 10), BlockCopy(7, 11)])
    tokens += result.token_ids + decode(steps, "a", 4, first_block=12)
    assert tokens == want


BAD_SWAPS = {
    "swap-out from a device block out of range": dict(swap_out=[BlockCopy(NUM_BLOCKS, 0)]),
    "swap-out to a host block out of range": dict(swap_out=[BlockCopy(3, 8)]),
    "swap-in from a host block out of range": dict(swap_in=[BlockCopy(8, 3)]),
    "swap-in to a device block out of range": dict(swap_in=[BlockCopy(0, -1)]),
    "two swap-outs into one host block": dict(swap_out=[BlockCopy(3, 1), BlockCopy(4, 1)]),
}


@pytest.mark.parametrize("fields", BAD_SWAPS.values(), ids=BAD_SWAPS.keys())
def test_bad_swap_is_rejected_without_touching_state(runner: ModelRunner, fields) -> None:
    steps = Steps(runner)
    steps.run(new_requests=[new("a", PROMPT, [0, 1])])
    before = runner.kv_cache.storage.clone(), runner.host_pool.storage.clone(), runner._last_step_id
    with pytest.raises(PlanError):
        steps.run(**fields)
    # Bitwise: the host pool is never zeroed, and its garbage may hold NaNs (NaN != NaN).
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    assert torch.equal(bits(runner.kv_cache.storage), bits(before[0]))
    assert torch.equal(bits(runner.host_pool.storage), bits(before[1]))
    assert runner._last_step_id == before[2]


def test_a_worker_without_swap_space_rejects_swaps(tiny_model_dir: str) -> None:
    config = WorkerConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                          num_gpu_blocks_override=NUM_BLOCKS)
    plain = ModelRunner(config, max_num_batched_tokens=64)
    assert plain.initialize().num_cpu_blocks == 0 and plain.host_pool is None
    with pytest.raises(PlanError, match="no host pool"):
        plain.execute(StepPlan(step_id=1, swap_out=[BlockCopy(0, 0)]))


# -- acceptance, through LLM ----------------------------------------------------------------

def run_llm(model_dir: str, prompts, params, **kwargs):
    """Generate, checking the scheduler's invariant (device and host pools) after every step."""
    llm = LLM(model=model_dir, dtype="float32", device="cpu", seed=0, block_size=16, **kwargs)
    check_invariants_every_step(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.stats()


def test_swap_is_token_identical_to_recompute_and_to_an_unconstrained_pool(tiny_model_dir: str) -> None:
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 2048) for _ in range(rng.randint(40, 90))]}
               for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 40), ignore_eos=True) for _ in prompts]
    roomy, roomy_stats = run_llm(tiny_model_dir, prompts, params)
    # 20 blocks of 16 = 320 slots for 12 sequences of ~100 tokens: preemption all along.
    tight = dict(num_gpu_blocks_override=20, enable_prefix_caching=False)
    recompute, recompute_stats = run_llm(tiny_model_dir, prompts, params, preemption_mode="recompute", **tight)
    # 64 KiB a block (16 slots): 2 MiB of swap space = 32 host blocks.
    swapped, swap_stats = run_llm(tiny_model_dir, prompts, params, preemption_mode="swap", swap_space=2 / 1024,
                                  **tight)
    assert roomy_stats.num_preemptions == 0
    assert recompute_stats.num_preemptions > 0 and swap_stats.num_preemptions > 0
    assert swap_stats.num_cpu_blocks == 32 and swap_stats.num_swap_preemptions > 0
    assert swap_stats.blocks_swapped_out > 0 and swap_stats.blocks_swapped_in > 0
    assert swap_stats.prefill_tokens_computed < recompute_stats.prefill_tokens_computed
    assert swapped == recompute == roomy
