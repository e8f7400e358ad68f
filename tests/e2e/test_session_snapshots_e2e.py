"""Session save / restore through real processes on loopback: two replicas (tiny model worker +
scheduler each, one shared --kv-snapshot-dir) behind one gateway, the openai client for the turns
(extra_body session_id) and httpx for POST /v1/sessions/{id}/save and /restore. A session's turn 1
runs on one replica; it is saved, then restored into the other replica (its 7 blocks loaded from the
files, none cached there before); the gateway routes turn 2 there (decision "session"), where it
hits the saved prefix (cached_tokens 112) and its greedy text equals the same turn's without a
session. A corrupt snapshot is refused (409), an unknown session is a 404, in OpenAI's error shape."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import start_scheduler, start_worker
from tests.e2e.gateway_conftest import start_gateway

WORKER_FLAGS = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 32}


def router_requests(http_url: str) -> dict[tuple[str, str], float]:
    """pagoda:router_requests by (replica, decision)."""
    return {(s.labels["replica"], s.labels["decision"]): s.value
            for family in text_string_to_metric_families(httpx.get(f"{http_url}/metrics").text)
            for s in family.samples if s.name == "pagoda:router_requests_total"}


@pytest.mark.timeout(600)
def test_a_saved_session_restores_on_the_other_replica_and_its_next_turn_goes_there(tiny_model_dir, tmp_path):
    snapshots = tmp_path / "snapshots"
    processes = []
    try:
        for i in range(2):
            (tmp_path / f"r{i}").mkdir()
            worker = start_worker(tiny_model_dir, tmp_path / f"r{i}", **WORKER_FLAGS, kv_snapshot_dir=snapshots)
            processes.append(worker)
            processes.append(start_scheduler(worker.target, tmp_path / f"r{i}"))
        gateway, http_url = start_gateway(f"{processes[1].target},{processes[3].target}", tmp_path)
        processes.append(gateway)
        client, model = OpenAI(base_url=f"{http_url}/v1", api_key="unused"), str(tiny_model_dir)
        rng = random.Random(11)
        history = [rng.randrange(10, 2000) for _ in range(120)]
        session = {"session_id": "chat", "session_ttl": 300}
        client.completions.create(model=model, prompt=history, max_tokens=8, temperature=0, extra_body=session)
        ((first, _),) = router_requests(http_url)  # the replica turn 1 ran on
        other = str(1 - int(first))
        turn2 = history + [7, 8, 9]
        expected = client.completions.create(model=model, prompt=turn2, max_tokens=8, temperature=0)

        saved = httpx.post(f"{http_url}/v1/sessions/chat/save", timeout=60)
        assert saved.status_code == 200, saved.text
        body = saved.json()
        # 120 prompt + 8 sampled tokens, 127 computed: 7 full blocks of 16 leased and saved
        assert (body["id"], body["object"], body["tokens"], body["blocks"]) == ("chat", "session.snapshot", 112, 7)
        folder = Path(body["path"])
        assert folder.parent == snapshots and len(list(folder.glob("*.safetensors"))) == 7
        assert body["bytes"] == sum(p.stat().st_size for p in folder.iterdir())

        restored = httpx.post(f"{http_url}/v1/sessions/chat/restore", json={"replica": int(other), "ttl": 300},
                              timeout=60)
        assert restored.status_code == 200, restored.text
        assert {k: restored.json()[k] for k in ("tokens", "blocks", "cached_tokens", "replica")} == \
            {"tokens": 112, "blocks": 7, "cached_tokens": 0, "replica": int(other)}  # all 7 loaded from files

        reply = client.completions.create(model=model, prompt=turn2, max_tokens=8, temperature=0, extra_body=session)
        assert reply.usage.prompt_tokens_details.cached_tokens == 112
        assert reply.choices[0].text == expected.choices[0].text
        assert router_requests(http_url).get((other, "session")) == 1.0

        missing = httpx.post(f"{http_url}/v1/sessions/nobody/save")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
        assert httpx.post(f"{http_url}/v1/sessions/nobody/restore").status_code == 404
        block = sorted(folder.glob("*.safetensors"))[3]
        raw = block.read_bytes()
        block.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # a flipped bit in its payload
        refused = httpx.post(f"{http_url}/v1/sessions/chat/restore", timeout=60)
        assert refused.status_code == 409 and "checksum" in refused.json()["error"]["message"]
    finally:
        for process in reversed(processes):
            process.stop()
