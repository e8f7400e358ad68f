"""Speculative decoding through the services: drafts travel in the plan, the gained tokens come back
as several result entries, and the streams are exactly what they are without speculation."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.contract.params import SamplingParams
from pagoda.v1 import engine_pb2_grpc
from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.server import EngineServiceConfig, start_engine_server
from tests.service.test_engine_service import collect, generate_request, wait_for_stats
from worker_svc.fake.fake_worker import FakeSampler
from worker_svc.fake.runner import FakeStepRunner
from worker_svc.server import start_worker_server

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
# the fake worker's fake draft model (worker_svc/fake/fake_draft.py): ModelDraft entries on the wire
DRAFT = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model="fake")


@pytest.mark.parametrize("spec", [SPEC, DRAFT], ids=["ngram", "draft_model"])
async def test_streams_with_drafts_match_the_reference(spec: SpeculativeConfig) -> None:
    runner = FakeStepRunner(num_blocks=64, block_size=4, max_model_len=128, vocab_size=3)
    worker, _, worker_port = await start_worker_server(runner, "127.0.0.1", 0)
    engine = await start_engine_server(EngineServiceConfig(workers=(f"127.0.0.1:{worker_port}",), port=0,
                                                           speculative=spec))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine.port}")
    stub = engine_pb2_grpc.EngineStub(channel)
    try:
        prompts = {f"r{i}": [1, 2, 0, 1, 2, 0, 1][: 4 + i] for i in range(4)}
        outputs = await asyncio.gather(*(collect(stub, generate_request(rid, p, 30)) for rid, p in prompts.items()))
        reference = FakeSampler(vocab_size=3)  # a small vocabulary: drafts get accepted
        params = SamplingParams(temperature=0.0, max_tokens=30)
        for (rid, prompt), (tokens, _) in zip(prompts.items(), outputs, strict=True):
            assert tokens[0] == reference.reference_stream(prompt, 0, params, 30, set()), rid
        stats = await wait_for_stats(stub, lambda s: s.idle)
        assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
        assert len(stats.spec_accepted_per_pos) >= 1 and stats.num_used_blocks == 0 and stats.invariant_ok
    finally:
        await channel.close()
        await engine.stop(0)
        await worker.stop(0)
