"""Live migration over gRPC in the scheduler (--kv-transfer grpc on the workers): the source's
handoff names its worker's transfer address; the target imports only what its worker can take (a
folder handoff on a gRPC worker or the reverse recomputes); and the target's service pulls the KV
before admission, dropping the import (the continuation recomputes, counted and logged) when the
pull fails, never failing the request."""

from __future__ import annotations

import dataclasses

import grpc

from pagoda.contract.ids import RequestId
from pagoda.contract.step import WorkerInfo
from scheduler_svc.core import Scheduler, SchedulerConfig
from scheduler_svc.core.request import KvHandoff
from scheduler_svc.kv_pulls import KvPulls
from tests.unit.test_migration import BS, MAX_TOKENS, PROMPT, Driver, request, run_to_end, undisturbed
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


def replica(folder: dict, address: str):
    cfg = SchedulerConfig(num_blocks=32, block_size=BS, max_model_len=128, eos_token_ids=(0,),
                          max_inflight_steps=2, kv_migration=True, kv_transfer_address=address)
    return Scheduler(cfg), FakeWorker(32, BS, FakeSampler(vocab_size=50), migrations=folder)


def _export(folder: dict, address: str):
    source, worker = replica(folder, address)
    src = Driver(source, worker)
    source.add_request(request("r"))
    streamed: list[int] = []
    while len(streamed) < 5:
        streamed += [t for d in src.step() for t in d.new_token_ids]
    source.export_request(RequestId("r"), "m1")
    _, _, handoff = run_to_end(src, "r")
    return streamed[:5], handoff


def test_the_handoff_names_the_source_worker_and_only_a_grpc_target_imports_it():
    expected = undisturbed()
    for target_address, imports in (("10.0.0.2:50061", True), ("", False)):
        folder: dict = {}
        streamed, handoff = _export(folder, "10.0.0.1:50061")
        assert handoff == KvHandoff("m1", 27, 7, source="10.0.0.1:50061")
        target, worker = replica(folder, target_address)
        dst = Driver(target, worker)
        target.add_request(request("r", PROMPT + tuple(streamed), MAX_TOKENS - 5, prior=5, handoff=handoff))
        rest, _, _ = run_to_end(dst, "r")
        assert streamed + rest == expected
        assert bool(dst.plans[0].kv_imports) is imports
        assert (target.stats().prefill_tokens_computed == 0) is imports


def test_a_folder_handoff_on_a_grpc_target_recomputes():
    folder: dict = {}
    streamed, handoff = _export(folder, "")
    assert handoff.source == ""
    target, worker = replica(folder, "10.0.0.2:50061")
    dst = Driver(target, worker)
    target.add_request(request("r", PROMPT + tuple(streamed), MAX_TOKENS - 5, prior=5, handoff=handoff))
    run_to_end(dst, "r")
    assert not dst.plans[0].kv_imports and target.stats().prefill_tokens_computed > 0


class FakeClient:
    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls = error, []

    async def pull_kv(self, migration_id, source, num_blocks, timeout_s):
        self.calls.append((migration_id, source, num_blocks))
        if self.error is not None:
            raise self.error
        return dataclasses.make_dataclass("R", ["num_blocks", "num_bytes"])(num_blocks, 1234)


class Unavailable(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                         details="failed to connect to all addresses")


GRPC_WORKER = WorkerInfo(num_blocks=32, block_size=BS, max_model_len=128, eos_token_ids=(0,), vocab_size=50, model_name="m",
                         kv_migration=True, kv_transfer_address="10.0.0.2:50061")
HANDOFF = KvHandoff("m1", 27, 7, source="10.0.0.1:50061")


async def test_a_successful_pull_keeps_the_import():
    client = FakeClient()
    pulls = KvPulls(client, GRPC_WORKER)
    continuation = request("r", PROMPT, prior=5, handoff=HANDOFF)
    assert await pulls.prepare(continuation) is continuation
    assert client.calls == [("m1", "10.0.0.1:50061", 7)]
    assert (pulls.num_pulls, pulls.num_fallbacks, pulls.num_bytes) == (1, 0, 1234)


async def test_a_failed_or_impossible_pull_drops_the_import_and_counts_it():
    for client, info in ((FakeClient(Unavailable()), GRPC_WORKER),
                         (FakeClient(), dataclasses.replace(GRPC_WORKER, kv_transfer_address="")),
                         (None, None)):
        pulls = KvPulls(client, info)
        prepared = await pulls.prepare(request("r", PROMPT, prior=5, handoff=HANDOFF))
        assert prepared.kv_import is None and prepared.prompt_token_ids == PROMPT
        assert (pulls.num_pulls, pulls.num_fallbacks) == (0, 1)


async def test_folder_and_snapshot_handoffs_are_not_pulled():
    client = FakeClient()
    pulls = KvPulls(client, GRPC_WORKER)
    for handoff in (KvHandoff("m1", 27, 7), KvHandoff("snap", 8, 2, snapshot=True), KvHandoff("m2", 0, 0, "a:1")):
        req = request("r", PROMPT, prior=5, handoff=handoff)
        assert await pulls.prepare(req) is req
    assert client.calls == [] and pulls.num_fallbacks == 0
