"""benchmarks/spec_sim.py: the replay of the forced copy task is exact where it can be."""

from __future__ import annotations

import pytest

from benchmarks import spec_sim
from scheduler_svc.core.spec.ngram import propose_ngram_matched


def test_a_flat_curve_turns_steps_saved_into_the_ratio() -> None:
    # The output repeats the prompt: every draft is accepted. With a flat curve (a step costs the
    # same whatever its rows) the ratio is the plain run's steps over the drafted run's.
    prompt = list(range(100, 200))
    output = list(range(100, 196))
    flat = spec_sim.curve_fn({1: 0.01, 100: 0.01})
    off = spec_sim.simulate([prompt], [output], flat, None)
    on = spec_sim.simulate([prompt], [output], flat, lambda t, n, alone: propose_ngram_matched(t, n, 1, 3), k=4)
    assert off["rate"] == pytest.approx(95 / (95 * 0.01))
    assert on["accepted_tokens"] == on["draft_tokens"]
    # 95 tokens after the first; the first step's match is 1 token (1 draft), then 2, then 4 a step
    steps = 95 - on["accepted_tokens"]
    assert on["rate"] / off["rate"] == pytest.approx(95 / steps)
    assert on["rate"] / off["rate"] > 4


def test_the_curve_interpolates_and_extends() -> None:
    t = spec_sim.curve_fn({"8": 1.0, "16": 2.0, "24": 2.5})
    assert t(8) == 1.0 and t(12) == 1.5 and t(20) == 2.25 and t(32) == 3.0 and t(1) == 1.0
