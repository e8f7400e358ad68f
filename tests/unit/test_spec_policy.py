"""The goodput policy for draft lengths (scheduler_svc/core/spec_policy.py) and the scheduler using it."""

from __future__ import annotations

import pytest

from scheduler_svc.core import SchedulerConfig
from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.spec.ngram import NgramSpeculator, propose_ngram
from scheduler_svc.core.spec_policy import (
    MIN_ALPHA,
    StepCostModel,
    acceptance_rate,
    choose_draft_lengths,
    record_outcome,
    update_record,
)
from tests.unit.test_fake_worker_property import expected
from tests.unit.test_spec_decode import repeating, small_vocab_run


def test_cost_model_recovers_a_line_and_waits_until_sizes_vary() -> None:
    model = StepCostModel()
    for _ in range(40):
        model.observe(8, 0.044)
    assert model.coefficients() is None  # one size only: the slope is unknown
    for tokens in (8, 16, 24, 40) * 10:
        model.observe(tokens, 0.02 + 0.003 * tokens)
    a, b = model.coefficients()
    assert a == pytest.approx(0.02, abs=2e-3) and b == pytest.approx(0.003, rel=0.05)
    model.observe(0, 1.0)  # untimed steps (fake workers, empty plans) are ignored
    assert model.coefficients() == (a, b)


def test_a_flat_stretch_makes_drafts_up_to_its_end_free() -> None:
    # 8 decoding sequences, 4 drafts each at alpha 0.6: on the line through these points a draft
    # does not pay (0.6 < the bar), but a step of 40 rows costs what one of 32 does, and past 24
    # the step is dear: the prefix with the most tokens per second ends at the flat stretch's end
    curve = {8: 0.095, 16: 0.108, 24: 0.1395, 32: 0.192, 40: 0.196, 48: 0.192}

    def seconds(tokens: int) -> float:
        return curve[8] if tokens <= 8 else min(v for m, v in curve.items() if m >= tokens)

    proposed, alphas = {f"s{i}": 4 for i in range(8)}, {f"s{i}": 0.6 for i in range(8)}
    chosen = choose_draft_lengths(proposed, alphas, 8, 8, seconds)
    assert sum(chosen.values()) == 8  # up to 16 rows: 8 first drafts, each worth 0.6 tokens
    alphas = {f"s{i}": 0.9 for i in range(8)}
    chosen = choose_draft_lengths(proposed, alphas, 8, 8, seconds)
    assert sum(chosen.values()) == 32  # likely drafts: through the dear stretch to 40 rows
    # a line is priced as before: the first-refusal rule
    assert choose_draft_lengths({"good": 4, "poor": 4}, {"good": 0.9, "poor": 0.5}, 8, 8,
                                lambda tokens: 0.02 + 0.005 * tokens) == {"good": 3, "poor": 0}


def test_record_outcome_counts_tries_up_to_the_first_rejection() -> None:
    assert record_outcome(4, 4) == (4, 4)  # all accepted: no rejection tried
    assert record_outcome(4, 1) == (1, 2)  # one accepted, the second rejected
    assert record_outcome(3, 0) == (0, 1)
    assert acceptance_rate(0, 0) == pytest.approx(0.75)  # the prior
    assert acceptance_rate(9, 10) > acceptance_rate(1, 10)


def test_the_record_follows_recent_runs_not_the_whole_life() -> None:
    accepts = tries = 0.0
    for _ in range(9):  # a copy: every draft accepted
        accepts, tries = update_record(accepts, tries, 4, 4)
    assert acceptance_rate(accepts, tries) > 0.9
    for _ in range(5):  # then the answer goes on in its own words: the first draft is rejected
        accepts, tries = update_record(accepts, tries, 4, 0)
    # lifetime counts would say (36 + 1.5) / (41 + 2) = 0.87; the last runs weigh most
    assert acceptance_rate(accepts, tries) == pytest.approx(0.44, abs=0.01)
    recovering = update_record(accepts, tries, 4, 4)  # copying again: it recovers at once
    assert acceptance_rate(*recovering) > 0.7
    for _ in range(20):  # drafts that always miss: the prior fades too, down to the floor
        accepts, tries = update_record(accepts, tries, 4, 0)
    assert acceptance_rate(accepts, tries) == MIN_ALPHA


def test_cheap_tokens_take_every_draft_and_dear_ones_none() -> None:
    proposed, alphas = {"a": 4, "b": 3}, {"a": 0.8, "b": 0.6}
    # batch-1-like: the step costs its fixed part, a token almost nothing
    assert choose_draft_lengths(proposed, alphas, 2, 2, (0.040, 0.0001)) == {"a": 4, "b": 3}
    # compute-bound: each token costs as much as the fixed part
    assert choose_draft_lengths(proposed, alphas, 2, 2, (0.001, 0.010)) == {"a": 0, "b": 0}


def test_drafts_go_to_the_likeliest_positions_first() -> None:
    # a=0.02, b=0.005, 8 decoding sequences: c(8)=0.06, G=8, bar = G*b/c = 0.667 for the first draft
    proposed, alphas = {"good": 4, "poor": 4}, {"good": 0.9, "poor": 0.5}
    chosen = choose_draft_lengths(proposed, alphas, 8, 8, (0.02, 0.005))
    assert chosen["poor"] == 0  # 0.5 < 0.667
    # good: 0.9 (bar .667) -> 0.81 (bar (8.9*.005)/.065=.685) -> 0.729 (bar .699) -> 0.656 (bar .713): 3
    assert chosen["good"] == 3


def test_the_policy_drafts_less_when_tokens_are_dear_and_streams_stay_exact(monkeypatch) -> None:
    # The uncapped prompt lookup (K drafts whatever the match): its later positions often miss on
    # this vocabulary, which is what the policy weighs. (The drafts cut to their match are mostly
    # certain here, and a certain draft pays at any cost: the policy rightly keeps them.)
    monkeypatch.setattr(NgramSpeculator, "draft",
                        lambda self, seq, limit: propose_ngram(seq.token_ids, limit, 1, 3))
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    config = SchedulerConfig(num_blocks=128, block_size=4, max_model_len=64, max_num_seqs=8,
                             max_num_batched_tokens=64, speculative=spec)
    drafted = {}
    for name, (a, b) in {"untimed": (0.0, 0.0), "cheap": (0.05, 0.0001), "dear": (0.001, 0.01)}.items():
        def timed(plan, result, a=a, b=b):  # the worker's reported step time: a + b * tokens
            tokens = len(result.request_ids) + sum(map(len, plan.draft_token_ids.values()))
            result.forward_seconds = a + b * tokens if a or b else 0.0
            return False

        run = small_vocab_run(config, timed, 4)
        requests = [repeating(f"r{i}", 48) for i in range(6)]
        run.go([(0, r) for r in requests])
        for request in requests:
            assert run.streams[(request.request_id, 0)] == expected(run.sampler, request, 0)
        assert run.scheduler.stats().num_used_blocks == 0
        # once the fit has seen enough steps (16 at least) the policy decides
        drafted[name] = sum(len(d) for plan, _, _ in run.steps[24:] for d in plan.draft_token_ids.values())
    # cheap: all but the unlikeliest last positions; dear: a draft must be near-certain to pay
    assert drafted["cheap"] >= 0.7 * drafted["untimed"] > 0
    assert drafted["dear"] < drafted["untimed"] / 4
