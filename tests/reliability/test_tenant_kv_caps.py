"""Two tenants, one flooding, over real processes (fake worker, scheduler with caps and fair share,
gateway with a keys file): the gateway's /metrics, scraped all through the run, never shows a
tenant above its KV cap, and the light tenant is served in full beside the flood.

The flood's cap comes from the keys file's `kv_share` (0.25 of 64 blocks = 16), the light tenant's
from the scheduler's --tenant-kv-share (0.5 = 32). A flood request ends at 14 blocks, so the cap
binds: the flood runs about one request at a time while 24 of its requests wait."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.conftest import FAKE_VOCAB_SIZE, start_stack

pytestmark = pytest.mark.slow

NUM_BLOCKS, BLOCK_SIZE = 64, 16
KEYS = [{"key": "sk-flood", "tenant": "flood", "kv_share": 0.25}, {"key": "sk-light", "tenant": "light"}]
CAPS = {"flood": 16, "light": 32}


def tenant_samples(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["tenant"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("pagoda:tenant_kv_blocks")}


class Scraper(threading.Thread):
    """GET /metrics back to back until stopped; keeps the largest held count per tenant."""

    def __init__(self, http_url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop_event = f"{http_url}/metrics", threading.Event()
        self.max_held: dict[str, float] = {}
        self.caps: dict[str, float] = {}
        self.scrapes = 0

    def run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self.stop_event.is_set():
                for (name, tenant), value in tenant_samples(client.get(self.url).text).items():
                    if name == "pagoda:tenant_kv_blocks":
                        self.max_held[tenant] = max(self.max_held.get(tenant, 0.0), value)
                    else:
                        self.caps[tenant] = value
                self.scrapes += 1


async def complete(client: httpx.AsyncClient, url: str, key: str, prompt: list[int], max_tokens: int) -> dict:
    reply = await client.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={
        "model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


async def flood_and_light(url: str) -> tuple[list[dict], list[dict]]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        flood = [asyncio.create_task(complete(client, url, "sk-flood", [(7 * i + j) % (FAKE_VOCAB_SIZE - 1) + 1
                                                                         for j in range(120)], 100))
                 for i in range(24)]
        light = [await complete(client, url, "sk-light", [(3 * i + j) % 500 + 1 for j in range(20)], 8)
                 for i in range(6)]  # one after the other, while the flood waits and runs
        return await asyncio.gather(*flood), light


def test_a_flooding_tenant_stays_within_its_kv_cap_and_the_other_is_served(tmp_path):
    keys = tmp_path / "keys.jsonl"
    keys.write_text("".join(json.dumps(entry) + "\n" for entry in KEYS))
    stack = start_stack(tmp_path, gateway_args=("--api-keys", str(keys)),
                        worker_flags={"num_gpu_blocks_override": NUM_BLOCKS},
                        scheduler_flags={"tenant_kv_share": 0.5, "tenant_fairness": "vtc"})
    try:
        scraper = Scraper(stack.http_url)
        scraper.start()
        try:
            flood, light = asyncio.run(flood_and_light(stack.http_url))
        finally:
            scraper.stop_event.set()
            scraper.join(30)
        assert [r["usage"]["completion_tokens"] for r in light] == [8] * 6
        assert [r["usage"]["completion_tokens"] for r in flood] == [100] * 24
        assert scraper.caps == CAPS and scraper.scrapes >= 10, (scraper.caps, scraper.scrapes)
        # Never above the cap, and the cap was what held the flood back (it came within one block).
        assert CAPS["flood"] - 1 <= scraper.max_held["flood"] <= CAPS["flood"], scraper.max_held
        assert scraper.max_held["light"] <= CAPS["light"]
        stats = stack.wait_idle()
        assert stats.invariant_ok and stats.tenant_generation_tokens == {"flood": 2400, "light": 48}
        assert stats.tenant_blocks_held["flood"] <= CAPS["flood"]  # (cached blocks stay, owned)
    finally:
        stack.stop()
