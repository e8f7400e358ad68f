"""Live migration with real processes: two replicas (tiny model, fp32, CPU: worker + scheduler each,
their workers sharing one --kv-migrate-dir) behind one gateway. A stream with a 1,920-token prompt
(the tiny model's context is 2,048: prompt + max_tokens fill it) is moved mid-stream with
POST /admin/migrate. The target loads the exported KV: 0 prefill tokens computed there (its
scheduler's counter), the client's stream (the real `openai` client) does not break and its
tokens equal an undisturbed run's, greedy and seeded; the source ends with no block in use and the
pool invariant holding. `-s` prints the time to move.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.e2e.conftest import free_port
from tests.e2e.gateway_conftest import start_gateway
from tests.reliability.conftest import Stack, scheduler_process, worker_process

pytestmark = pytest.mark.slow
PROMPT = [(i * 7919) % 2000 + 10 for i in range(1920)]
MAX_TOKENS = 128  # 1,920 + 128 = the tiny model's 2,048 positions
MOVE_AFTER = 8  # tokens streamed before the move


@pytest.fixture
def replicas(tmp_path, tiny_model_dir):
    stacks, gateway = [], None
    flags = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 512,
             "kv_migrate_dir": str(tmp_path / "migrate")}
    try:
        for _ in range(2):
            worker = worker_process(tmp_path, free_port(), tiny_model_dir, **flags)
            scheduler = scheduler_process(worker.target, tmp_path, free_port())
            stacks.append(Stack(tmp_path, worker, scheduler, model=tiny_model_dir))
        for stack in stacks:
            stack.scheduler.wait_serving()
        gateway, url = start_gateway(",".join(s.scheduler.target for s in stacks), tmp_path,
                                     "--replica-stats-interval", "0.1")
        yield stacks, url
    finally:
        for process in (gateway, *stacks):
            if process is not None:
                process.stop()


def _stream(client: openai.OpenAI, model: str, sampling: dict):
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True, logprobs=1,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **sampling)


def _tokens(chunks) -> list[int]:
    return [int(t.removeprefix("token_id:")) for chunk in chunks for c in chunk.choices
            if c.logprobs is not None for t in c.logprobs.tokens]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_2k_context_moves_between_replicas_without_prefill(replicas, sampling):
    stacks, url = replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    expected = list(_stream(client, model, sampling))
    for stack in stacks:
        stack.wait_idle()
    before = [stack.stats() for stack in stacks]

    chunks, moved, mover = [], {}, None
    for chunk in _stream(client, model, sampling):  # raises if the stream errors
        chunks.append(chunk)
        if mover is None and len(_tokens(chunks)) >= MOVE_AFTER:
            def move(request_id=chunk.id):
                reply = httpx.post(f"{url}/admin/migrate", json={"request_id": request_id}, timeout=60)
                moved.update(reply.json(), status=reply.status_code)
            mover = threading.Thread(target=move)
            mover.start()  # the client keeps reading while the gateway moves the stream
    mover.join(60)
    assert moved.get("status") == 200 and moved["migrated"], moved  # it moved before the stream ended

    source, target = stacks[moved["source"]], stacks[moved["target"]]
    assert moved["source"] != moved["target"]
    after = [stack.wait_idle() for stack in stacks]
    i = moved["target"]
    # The target loaded the whole context: 0 prefill tokens computed, yet it generated the rest.
    assert after[i].prefill_tokens_computed - before[i].prefill_tokens_computed == 0
    assert after[i].generation_tokens - before[i].generation_tokens > 0
    assert moved["num_kv_tokens"] >= len(PROMPT) + MOVE_AFTER - 1 and moved["num_kv_blocks"] >= 120
    # The client saw one stream, token for token the undisturbed one, with the same usage.
    assert _tokens(chunks) == _tokens(expected) and len(_tokens(chunks)) == MAX_TOKENS
    usage, undisturbed = chunks[-1].usage, expected[-1].usage  # (cached tokens differ: the first run cached the prompt)
    assert (usage.prompt_tokens, usage.completion_tokens) == (undisturbed.prompt_tokens, undisturbed.completion_tokens)
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    # The source let everything go: no block in use, the pool invariant, nothing resident.
    stats = source.stats()
    assert stats.num_used_blocks == 0 and stats.invariant_ok and stats.worker_resident_requests == 0
    assert stats.request_success["migrated"] == before[moved["source"]].request_success["migrated"] + 1
    assert target.stats().invariant_ok
    assert not any((source.log_dir / "migrate").rglob("*.safetensors"))  # the target took the files
    print(f"\nlive migration ({sampling}): {moved['num_kv_tokens']} tokens in {moved['num_kv_blocks']} blocks "
          f"moved replica {moved['source']} -> {moved['target']}: export {moved['export_seconds'] * 1e3:.1f} ms, "
          f"first token on the target {moved['move_seconds'] * 1e3:.1f} ms after the ask")
