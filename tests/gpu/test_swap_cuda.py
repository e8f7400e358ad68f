"""Swap preemption on CUDA (skipped on CPU machines; passed on an H200, 2026-11-26): the host pool is page-locked
and its copies move every layer between device and host exactly; through LLM on the tiny model,
swap gives the tokens of recompute and of an unconstrained pool."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.contract.step import BlockCopy
from pagoda.tools.tiny_model import write_model
from worker_svc.kv_cache import CacheShape, HostKVPool, KVCache


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("models") / "pagoda-tiny"
    write_model(out)
    return str(out)


def test_pinned_host_pool_round_trip() -> None:
    shape = CacheShape(num_layers=3, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = KVCache(shape, 8, torch.device("cuda"))
    host = HostKVPool(shape, 4, pin_memory=True)
    assert host.storage.is_pinned()
    cache.storage.copy_(torch.randn(cache.storage.shape, device="cuda").to(shape.dtype))
    before = cache.storage.clone()
    host.apply(cache, [BlockCopy(5, 3), BlockCopy(1, 0)], [])
    cache.storage[:, :, [1, 5]] = 0
    host.apply(cache, [], [BlockCopy(3, 6), BlockCopy(0, 7)])
    torch.cuda.synchronize()
    assert torch.equal(cache.storage[:, :, 6], before[:, :, 5]) and torch.equal(cache.storage[:, :, 7], before[:, :, 1])


def test_swap_gives_recompute_tokens_on_cuda(tiny_model_dir: str) -> None:
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 2048) for _ in range(rng.randint(40, 90))]} for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs = {}
    for name, kwargs in (("roomy", {}), ("recompute", {"preemption_mode": "recompute"}),
                         ("swap", {"preemption_mode": "swap", "swap_space": 2 / 1024})):
        tight = {"num_gpu_blocks_override": 20} if name != "roomy" else {}
        with LLM(model=tiny_model_dir, dtype="float32", device="cuda", block_size=16, **tight, **kwargs) as llm:
            runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.stats()
        if name == "swap":
            assert stats.num_swap_preemptions > 0 and stats.blocks_swapped_in > 0
    assert runs["swap"] == runs["recompute"] == runs["roomy"]
