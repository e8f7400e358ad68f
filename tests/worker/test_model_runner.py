"""ModelRunner: plan validation leaves state untouched, block copies, chunking and forks."""

from __future__ import annotations

import pytest
import torch

from pagoda.contract.errors import PlanError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import BlockCopy, Fork, NewRequestData, StepPlan, TableUpdate
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [1, 17, 33, 49, 65, 81, 97]  # 7 tokens: two blocks of 4


@pytest.fixture(scope="module")
def runner(tiny_model_dir: str) -> ModelRunner:
    config = WorkerConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                          num_gpu_blocks_override=NUM_BLOCKS)
    runner = ModelRunner(config, max_num_batched_tokens=64)
    info = runner.initialize()
    assert (info.num_blocks, info.block_size) == (NUM_BLOCKS, BLOCK_SIZE)
    return runner


class Steps:
    """Numbers plans consecutively, as the scheduler does."""

    def __init__(self, runner: ModelRunner) -> None:
        runner.reset()
        self.runner, self.next_id = runner, 0

    def plan(self, **fields) -> StepPlan:
        self.next_id += 1
        return StepPlan(step_id=self.next_id, **fields)

    def run(self, **fields):
        return self.runner.execute(self.plan(**fields))


def new_request(rid: str, tokens: list[int], blocks: list[int], scheduled: int | None = None,
                computed: int = 0, sampling: SamplingParams = GREEDY) -> NewRequestData:
    return NewRequestData(RequestId(rid), list(tokens), len(tokens), list(blocks), computed,
                          scheduled if scheduled is not None else len(tokens) - computed, sampling)


def snapshot(runner: ModelRunner):
    states = {rid: (list(s.token_ids), list(s.block_ids), s.num_computed_tokens, s.seq_index)
              for rid, s in runner.requests.items()}
    return states, runner._last_step_id, runner.kv_cache.storage.clone()


BAD_PLANS = {
    "unknown finished id": dict(finished_ids=[RequestId("nope")]),
    "unknown preempted id": dict(preempted_ids=[RequestId("nope")]),
    "unknown table update id": dict(table_updates=[TableUpdate(RequestId("nope"), 0, [3])]),
    "unknown scheduled id": dict(num_scheduled_tokens={RequestId("nope"): 2}),
    "unknown fork parent": dict(forks=[Fork(RequestId("nope"), [RequestId("nope#1")])]),
    "duplicate new request": dict(new_requests=[new_request("a", [5, 6], [9])]),
    "new request block out of range": dict(new_requests=[new_request("b", [5, 6], [NUM_BLOCKS])]),
    "table update block out of range": dict(table_updates=[TableUpdate(RequestId("a"), 2, [-1])]),
    "table update leaves a hole": dict(table_updates=[TableUpdate(RequestId("a"), 3, [5])]),
    "block copy out of range": dict(block_copies=[BlockCopy(2, NUM_BLOCKS + 3)]),
    # "a" holds 8 tokens in 2 blocks of 4: its 9th token needs a third block.
    "over table capacity": dict(new_requests=[new_request("c", PROMPT + [1, 2], [3, 4])]),
    "over remaining tokens": dict(num_scheduled_tokens={RequestId("a"): 2}),
    "fork of a request that does not sample": dict(
        new_requests=[new_request("d", PROMPT, [5, 6], scheduled=3)],
        forks=[Fork(RequestId("d"), [RequestId("d#1")])]),
}


@pytest.mark.parametrize("fields", BAD_PLANS.values(), ids=BAD_PLANS.keys())
def test_bad_plan_is_rejected_without_touching_state(runner: ModelRunner, fields) -> None:
    steps = Steps(runner)
    steps.run(new_requests=[new_request("a", PROMPT, [0, 1])])  # "a" now has 8 tokens, 7 computed
    before = snapshot(runner)
    with pytest.raises(PlanError):
        runner.execute(steps.plan(**fields))
    after = snapshot(runner)
    assert after[:2] == before[:2]
    assert torch.equal(after[2], before[2])


def test_step_gap_is_rejected(runner: ModelRunner) -> None:
    steps = Steps(runner)
    steps.run(new_requests=[new_request("a", PROMPT, [0, 1])])
    with pytest.raises(PlanError, match="does not follow"):
        runner.execute(StepPlan(step_id=steps.next_id + 2))


def test_block_copy_copies_every_layer(runner: ModelRunner) -> None:
    steps = Steps(runner)
    storage = runner.kv_cache.storage  # [L, 2, num_blocks, block_size, H, D]
    storage.copy_(torch.randn_like(storage))
    before = storage.clone()
    steps.run(block_copies=[BlockCopy(5, 7), BlockCopy(6, 8)])
    assert storage.shape[0] > 1
    torch.testing.assert_close(storage[:, :, 7], before[:, :, 5], rtol=0, atol=0)
    torch.testing.assert_close(storage[:, :, 8], before[:, :, 6], rtol=0, atol=0)
    untouched = [b for b in range(NUM_BLOCKS) if b not in (7, 8)]
    assert torch.equal(storage[:, :, untouched], before[:, :, untouched])


def greedy_tokens(runner: ModelRunner, chunks: list[int], decode_steps: int) -> list[int]:
    """Prefill PROMPT in `chunks`, then decode; the tokens sampled, in order."""
    steps = Steps(runner)
    first = new_request("a", PROMPT, [0, 1], scheduled=chunks[0])
    results = [steps.run(new_requests=[first])]
    for chunk in chunks[1:]:
        results.append(steps.run(num_scheduled_tokens={RequestId("a"): chunk}))
    for i in range(decode_steps):  # decode token k sits at position 7 + k; block 2 from position 8
        updates = [TableUpdate(RequestId("a"), 2, [2])] if i == 0 else []
        results.append(steps.run(table_updates=updates))
    return [t for r in results for t in r.token_ids]


def test_chunked_prefill_matches_one_shot_prefill(runner: ModelRunner) -> None:
    one_shot = greedy_tokens(runner, [7], decode_steps=3)
    chunked = greedy_tokens(runner, [3, 2, 2], decode_steps=3)
    assert len(one_shot) == 4
    assert chunked == one_shot
    assert runner.requests[RequestId("a")].token_ids == PROMPT + one_shot


def test_fork_children_sample_from_the_parent_logits(runner: ModelRunner) -> None:
    steps = Steps(runner)
    seeded = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=4)
    children = [RequestId("p#1"), RequestId("p#2")]
    result = steps.run(new_requests=[new_request("p", PROMPT, [0, 1], sampling=seeded)],
                       forks=[Fork(RequestId("p"), children)])
    assert result.request_ids == ["p", "p#1", "p#2"]
    assert [runner.requests[c].seq_index for c in children] == [1, 2]
    for rid, token in zip(result.request_ids, result.token_ids, strict=True):
        state = runner.requests[rid]
        assert state.token_ids == PROMPT + [token]
        assert state.block_ids == [0, 1] and state.num_computed_tokens == len(PROMPT)
    # The same fork again: seeded randomness depends only on (seed, seq_index, position).
    again = Steps(runner).run(new_requests=[new_request("p", PROMPT, [3, 4], sampling=seeded)],
                              forks=[Fork(RequestId("p"), children)])
    assert again.token_ids == result.token_ids
    # The next decode step runs all three sequences (the scheduler gives each its own block).
    updates = [TableUpdate(rid, 2, [5 + i]) for i, rid in enumerate(result.request_ids)]
    decode = steps.run(table_updates=updates)
    assert decode.request_ids == ["p", "p#1", "p#2"]
    assert runner.num_resident == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_cpu_without_reduced_precision_onednn_serves_with_plain_linears(tiny_model_dir, monkeypatch, dtype):
    """The fallback forced: packing refused (as fp16 is on a CPU without avx512_fp16 /
    avx_ne_convert), the worker keeps nn.Linear and decodes what the packed model decodes."""
    from torch import nn

    from worker_svc.models import packed_linear

    def tokens(runner_config: WorkerConfig) -> tuple[list[int], ModelRunner]:
        runner = ModelRunner(runner_config, max_num_batched_tokens=64)
        runner.initialize()
        return greedy_tokens(runner, [7], decode_steps=3), runner

    config = WorkerConfig(model=tiny_model_dir, dtype=dtype, device="cpu", block_size=BLOCK_SIZE,
                          num_gpu_blocks_override=NUM_BLOCKS)
    plain_config = WorkerConfig(model=tiny_model_dir, dtype=dtype, device="cpu", block_size=BLOCK_SIZE,
                                num_gpu_blocks_override=NUM_BLOCKS, pack_weights=False)
    expected, _ = tokens(plain_config)
    monkeypatch.setattr(packed_linear, "cpu_packs_dtype", lambda _dtype: False)
    got, fallback = tokens(config)
    linears = [m for m in fallback.model.modules() if isinstance(m, nn.Linear | packed_linear.PackedLinear)]
    assert linears and all(type(m) is nn.Linear for m in linears)
    assert got == expected and len(got) == 4


def test_a_step_marks_its_parts_in_order(runner):
    """The instants the worker's step timeline reads (benchmarks/step_timeline.py): execute's
    start, inputs built, logits, sampled, each within the step's own wall time."""
    import time

    steps = Steps(runner)
    steps.run(new_requests=[new_request("m", PROMPT, [0, 1])])
    before = time.perf_counter()
    result = steps.run()  # a decode step
    after = time.perf_counter()
    marks = runner.marks
    assert before <= marks.started <= marks.inputs_built <= marks.logits_done <= marks.sampled <= after
    assert result.token_ids and len(result.token_ids) == 1
