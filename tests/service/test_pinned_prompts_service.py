"""--pinned-prompts through the scheduler service: prefilled at start, hit by the first request."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.pinned_prompts import PinnedPromptsError, load_pinned_prompts, resolve_pinned_prompts
from tests.service.conftest import BLOCK_SIZE
from tests.service.test_engine_service import collect, generate_request, wait_for_stats

SYSTEM = list(range(10, 10 + 3 * BLOCK_SIZE + 1))  # 3 full blocks


async def test_the_first_request_after_start_hits_the_pinned_prompt(engine_factory):
    _, stub = await engine_factory(pinned_prompts=(SYSTEM,))
    stats = await wait_for_stats(stub, lambda s: s.idle)  # the pin was prefilled by the first steps
    assert stats.num_pinned_blocks == 3 and stats.num_used_blocks == 3
    _, responses = await collect(stub, generate_request("first-user", SYSTEM + [7, 8], 4))
    assert responses[-1].num_cached_tokens == 3 * BLOCK_SIZE


def test_the_file_format_is_checked(tmp_path) -> None:
    good = tmp_path / "pins.json"
    good.write_text(json.dumps([[1, 2, 3], "You are a helpful assistant.",
                                {"messages": [{"role": "system", "content": "Be brief."}]}]))
    entries = load_pinned_prompts(str(good))
    assert resolve_pinned_prompts(entries[:1], "/nonexistent") == [[1, 2, 3]]  # ids need no tokenizer
    with pytest.raises(PinnedPromptsError, match="need the model's tokenizer"):
        resolve_pinned_prompts(entries, "/nonexistent")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[1, -2]]))
    with pytest.raises(PinnedPromptsError, match="entry 0"):
        load_pinned_prompts(str(bad))
