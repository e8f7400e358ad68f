"""The undisturbed outputs a soak's greedy requests are checked against (benchmarks/soak.py).

Every valid request of the soak is greedy with `ignore_eos` and a fixed max_tokens, so its text is a
function of its prompt alone (DESIGN.md: greedy output is identical whatever the batch mix, prefix
hit, preemption or replica). The reference is taken from the same stack, in a pass with no fault and
no hang-up: the prompts go in batches (a list of prompts per `/v1/completions` call, choice i
answering prompt i), which costs the engine the same tokens and the gateway far fewer requests
than the soak itself. `--expected-file` keeps the texts, keyed by what determines them, so a run can
reuse the reference of an earlier one on the same model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from benchmarks.result_file import write_result


async def reference_texts(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                          bodies: dict[int, dict], batch: int = 32, concurrency: int = 4) -> dict[int, str]:
    """{request index: completion text} for `bodies` (greedy, same max_tokens), sent `batch` prompts a call."""
    items = sorted(bodies.items())
    calls = [items[i:i + batch] for i in range(0, len(items), batch)]
    slots = asyncio.Semaphore(concurrency)
    texts: dict[int, str] = {}

    async def one(call: list[tuple[int, dict]]) -> None:
        first = call[0][1]
        body = {"prompt": [b["prompt"] for _, b in call], "max_tokens": first["max_tokens"],
                "temperature": 0, "ignore_eos": True}
        async with slots:
            response = await client.post(url, json=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"reference pass: HTTP {response.status_code} {response.text[:200]!r}")
        for choice in response.json()["choices"]:
            texts[call[choice["index"]][0]] = choice["text"]

    await asyncio.gather(*(one(call) for call in calls))
    return texts


def load(path: Path | None, key: dict) -> dict[int, str] | None:
    """The texts saved in `path` under the same `key` (model, seed, shapes), else None."""
    if path is None or not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved.get("key") != key:
        return None
    return {int(i): text for i, text in saved["texts"].items()}


def save(path: Path | None, key: dict, texts: dict[int, str]) -> None:
    if path is not None:
        write_result(path, {"key": key, "texts": texts})


def mismatches(outcomes: list, expected: dict[int, str]) -> list[dict]:
    """Requests whose text differs from the reference: a completed one's whole text, a hung-up
    stream's text so far (it must be a prefix). `outcomes[i]` is request i's Outcome."""
    wrong = []
    for index, outcome in enumerate(outcomes):
        want = expected.get(index)
        if want is None or outcome.text is None:
            continue
        ok = outcome.text == want if outcome.kind == "completed" else want.startswith(outcome.text)
        if not ok:
            wrong.append({"request": index, "kind": outcome.kind, "got": outcome.text, "expected": want})
    return wrong
