"""Worker memory stays flat over many requests of every batch shape (docs/reliability.md, "Worker
memory"): no per-request state outlives its request, and the oneDNN-packed linears see only the
row buckets (worker_svc/models/row_buckets.py), so oneDNN's shape-keyed primitive caches stay bounded."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from worker_svc.models.packed_linear import PackedLinear, can_pack
from worker_svc.models.row_buckets import RowBucketedLinear, buckets_up_to

MAX_BATCHED = 96

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="torch built without oneDNN")


def test_many_shapes_reach_the_packed_linears_as_few_buckets(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_batched_tokens=MAX_BATCHED,
              max_num_seqs=24, num_gpu_blocks_override=256)
    runner = llm.runner
    wrapped = [m for m in runner.model.modules() if isinstance(m, RowBucketedLinear)]
    packed = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert wrapped and len(wrapped) == len(packed)  # every packed linear is behind a bucket
    step_tokens: set[int] = set()  # the rows the model was asked for
    linear_rows: set[int] = set()  # the rows oneDNN was asked for
    hooks = [m.register_forward_pre_hook(lambda _m, args: linear_rows.add(args[0].shape[0])) for m in packed]
    hooks.append(runner.model.register_forward_pre_hook(lambda _m, args: step_tokens.add(args[0].shape[0])))
    rng = random.Random(0)
    for length in range(3, 90, 2):  # a prefill of every other length, one request at a time
        prompt = {"prompt_token_ids": [rng.randrange(2, 1000) for _ in range(length)]}
        [output] = llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
                                use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 2
    for hook in hooks:
        hook.remove()
    # The scheduler names a finished request to the worker in the next plan; offline, the next
    # generate sends it. Send it now: then nothing of any request may be left on the worker.
    assert runner.num_resident > 0
    plan = llm.scheduler.schedule()
    llm.scheduler.update(runner.execute(plan))
    assert runner.num_resident == 0 and not runner.requests and not runner.unsampled
    assert len(step_tokens) >= 20, sorted(step_tokens)  # the shapes did vary ...
    assert linear_rows <= {0, *buckets_up_to(MAX_BATCHED)}  # ... but oneDNN saw only buckets
    assert len(linear_rows) < len(step_tokens)


def test_the_worker_builds_every_bucket_its_limits_reach_at_start(tiny_model_dir, monkeypatch):
    """The row buckets' warm-up (`warm_row_buckets`, at the first initialize): each distinct linear
    shape runs once per bucket up to max_num_batched_tokens, the lm_head up to max_num_seqs, so no
    bucket is first met (and its oneDNN primitive built, RSS stepping up) under load."""
    seen: dict[tuple[int, int], list[int]] = {}  # (in, out) -> rows, in call order
    real = PackedLinear.forward

    def forward(self, x):
        seen.setdefault((self.in_features, self.out_features), []).append(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(PackedLinear, "forward", forward)
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_batched_tokens=MAX_BATCHED,
              max_num_seqs=24, num_gpu_blocks_override=64, warmup_row_buckets=True)
    lm_head = llm.runner.model.lm_head.linear
    shapes = {(m.in_features, m.out_features) for m in llm.runner.model.modules() if isinstance(m, PackedLinear)}
    assert set(seen) == shapes
    for shape, rows in seen.items():
        limit = 24 if shape == (lm_head.in_features, lm_head.out_features) else MAX_BATCHED
        assert rows == buckets_up_to(limit), shape  # each once, ascending
