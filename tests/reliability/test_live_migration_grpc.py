"""Live migration over gRPC with real processes: two replicas (tiny model, fp32, CPU: worker +
scheduler each) that share NO folder (each its own tmp dir, no --kv-migrate-dir; the workers run
--kv-transfer grpc) behind one gateway. A stream with a 1,920-token prompt is moved mid-stream with
POST /admin/migrate: the target's worker pulls the KV from the source's worker (KvTransfer.FetchKv),
computes 0 prefill tokens, and the client's stream (the real `openai` client) equals an undisturbed
run's token for token; a drain of the replica serving a stream does the same. Then, on the same processes, continuations whose handoff cannot be served
(an export the source does not hold; a source that is gone) recompute instead: the same tokens,
counted as fallbacks, never a hung or failed request. `-s` prints the time to move.
"""

from __future__ import annotations

import threading

import grpc
import httpx
import openai
import pytest

from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.e2e.conftest import free_port
from tests.e2e.gateway_conftest import start_gateway
from tests.reliability.conftest import Stack, scheduler_process, worker_process

pytestmark = pytest.mark.slow
PROMPT = [(i * 7919) % 2000 + 10 for i in range(1920)]
MAX_TOKENS = 128  # 1,920 + 128 = the tiny model's 2,048 positions
MOVE_AFTER = 8  # tokens streamed before the move
BS = 16


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_model_dir):
    stacks, gateway = [], None
    flags = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 512, "kv_transfer": "grpc"}
    try:
        for name in ("host-a", "host-b"):  # nothing shared: each replica its own directory
            home = tmp_path_factory.mktemp(name)
            worker = worker_process(home, free_port(), tiny_model_dir, **flags)
            scheduler = scheduler_process(worker.target, home, free_port())
            stacks.append(Stack(home, worker, scheduler, model=tiny_model_dir))
        for stack in stacks:
            stack.scheduler.wait_serving()
        gateway, url = start_gateway(",".join(s.scheduler.target for s in stacks), stacks[0].log_dir,
                                     "--replica-stats-interval", "0.1")
        yield stacks, url
    finally:
        for process in (gateway, *stacks):
            if process is not None:
                process.stop()


def _stream(client: openai.OpenAI, model: str):
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True, logprobs=1, temperature=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})


def _tokens(chunks) -> list[int]:
    return [int(t.removeprefix("token_id:")) for chunk in chunks for c in chunk.choices
            if c.logprobs is not None for t in c.logprobs.tokens]


@pytest.fixture(scope="module")
def expected(replicas) -> list[int]:
    stacks, url = replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    tokens = _tokens(_stream(client, client.models.list().data[0].id))
    for stack in stacks:
        stack.wait_idle()
    assert len(tokens) == MAX_TOKENS
    return tokens


def test_a_2k_context_moves_worker_to_worker_over_grpc_without_prefill(replicas, expected):
    stacks, url = replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    before = [stack.stats() for stack in stacks]
    chunks, moved, mover = [], {}, None
    for chunk in _stream(client, client.models.list().data[0].id):  # raises if the stream errors
        chunks.append(chunk)
        if mover is None and len(_tokens(chunks)) >= MOVE_AFTER:
            def move(request_id=chunk.id):
                reply = httpx.post(f"{url}/admin/migrate", json={"request_id": request_id}, timeout=60)
                moved.update(reply.json(), status=reply.status_code)
            mover = threading.Thread(target=move)
            mover.start()
    mover.join(60)
    assert moved.get("status") == 200 and moved["migrated"], moved
    after = [stack.wait_idle() for stack in stacks]
    i, source = moved["target"], moved["source"]
    assert i != source
    # The target pulled the whole context from the source's worker and computed none of it.
    assert after[i].prefill_tokens_computed - before[i].prefill_tokens_computed == 0
    assert after[i].generation_tokens - before[i].generation_tokens > 0
    assert (after[i].kv_pulls - before[i].kv_pulls, after[i].kv_pull_fallbacks - before[i].kv_pull_fallbacks) == (1, 0)
    assert moved["num_kv_tokens"] >= len(PROMPT) + MOVE_AFTER - 1 and moved["num_kv_blocks"] >= 120
    assert after[i].kv_pull_bytes - before[i].kv_pull_bytes > moved["num_kv_blocks"] * BS * 4  # bytes crossed
    assert _tokens(chunks) == expected  # greedy-identical to the undisturbed run
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    stats = stacks[source].stats()
    assert stats.num_used_blocks == 0 and stats.invariant_ok and stats.worker_resident_requests == 0
    assert stacks[i].stats().invariant_ok
    for stack in stacks:  # no file went anywhere: the KV crossed on the workers' gRPC ports
        assert not list(stack.log_dir.rglob("*.safetensors"))
    print(f"\nlive migration over gRPC: {moved['num_kv_tokens']} tokens in {moved['num_kv_blocks']} blocks "
          f"({(after[i].kv_pull_bytes - before[i].kv_pull_bytes) / 2**20:.1f} MiB) moved replica {source} -> {i}: "
          f"export {moved['export_seconds'] * 1e3:.1f} ms, first token on the target "
          f"{moved['move_seconds'] * 1e3:.1f} ms after the ask")


@pytest.mark.parametrize("where", ["unknown_export", "source_gone"])
def test_a_handoff_that_cannot_be_pulled_recomputes_the_same_tokens(replicas, expected, where):
    stacks, _ = replicas
    target, source = stacks
    prior = 4  # a continuation after 4 streamed tokens, as the gateway sends it
    address = source.worker.target if where == "unknown_export" else f"127.0.0.1:{free_port()}"
    num_tokens = len(PROMPT) + prior - 1
    handoff = common_pb2.KvHandoff(migration_id=f"never-exported-{where}", num_tokens=num_tokens,
                                   num_blocks=-(-num_tokens // BS), source=address)
    request = engine_pb2.GenerateRequest(
        request_id=f"fallback-{where}", prompt_token_ids=PROMPT + expected[:prior], num_prior_output_tokens=prior,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), kv_import=handoff)
    before = target.stats()
    with grpc.insecure_channel(target.scheduler.target) as channel:
        responses = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))
    tokens = [t for r in responses for d in r.sequences for t in d.token_ids]
    assert tokens == expected[prior:prior + 8]  # recomputed: the same greedy tokens
    after = target.wait_idle()
    assert (after.kv_pulls - before.kv_pulls, after.kv_pull_fallbacks - before.kv_pull_fallbacks) == (0, 1)
    assert after.invariant_ok


def test_a_drain_moves_the_running_stream_over_grpc(replicas, expected):
    stacks, url = replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    before = [stack.stats() for stack in stacks]
    chunks, drained, drainer = [], {}, None
    for chunk in _stream(client, client.models.list().data[0].id):
        chunks.append(chunk)
        if drainer is None and len(_tokens(chunks)) >= MOVE_AFTER:
            holder = next(i for i, stack in enumerate(stacks) if stack.stats().num_running)

            def drain(replica=holder):
                reply = httpx.post(f"{url}/admin/drain", json={"replica": replica}, timeout=60)
                drained.update(reply.json(), status=reply.status_code)
            drainer = threading.Thread(target=drain)
            drainer.start()
    drainer.join(60)
    try:
        assert drained.get("status") == 200 and drained["drained"], drained
        [move] = drained["moves"]
        assert move["migrated"] and move["source"] == drained["replica"] != move["target"], drained
        i = move["target"]
        after = stacks[i].wait_idle()
        assert after.prefill_tokens_computed - before[i].prefill_tokens_computed == 0
        assert (after.kv_pulls - before[i].kv_pulls, after.kv_pull_fallbacks - before[i].kv_pull_fallbacks) == (1, 0)
        assert _tokens(chunks) == expected
    finally:
        httpx.post(f"{url}/admin/drain", json={"replica": drained.get("replica", 0), "undrain": True}, timeout=10)
