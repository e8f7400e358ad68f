"""n-gram speculative decoding in the scheduler core, against the fake worker's verifier.

The fake worker accepts a draft exactly when its deterministic sampler would have produced that
token, so every stream must equal the reference stream with speculation on, whatever was proposed,
accepted or rolled back; the block accounting must hold after every step (rejected drafts never
leak blocks or prefix hashes).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from scheduler_svc.core import EngineRequest, SchedulerConfig
from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.spec.ngram import propose_ngram, propose_ngram_matched
from tests.unit.test_fake_worker_property import EOS, expected, traces
from tests.unit.test_poison_isolation import Run
from worker_svc.fake.fake_worker import FakeSampler

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize(("tokens", "k", "want"), [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # the 3-gram [1, 2, 3] seen before: what followed it
    ([5, 1, 2, 7, 7, 1, 2], 4, [7, 7, 1, 2]),
    ([1, 2, 8, 1, 2, 9, 1, 2], 1, [9]),  # the most recent earlier match wins
    ([1, 2, 3, 4], 3, []),  # no repeated n-gram
    ([4, 4], 3, [4]),  # n=1: the token after the earlier 4
])
def test_propose_ngram(tokens: list[int], k: int, want: list[int]) -> None:
    assert propose_ngram(tokens, k, 1, 3) == want


def test_propose_respects_the_minimum_ngram() -> None:
    assert propose_ngram([1, 2, 3, 9, 5, 3], 2, 2, 3) == []  # only the 1-gram [3] repeats
    assert propose_ngram([1, 2, 3, 9, 5, 3], 2, 1, 3) == [9, 5]


@pytest.mark.parametrize(("tokens", "k", "want"), [
    # [1, 2] matched at 1; before it 5 != 7: a 2-token match earns 2 drafts (prompt lookup: 4)
    ([5, 1, 2, 7, 7, 1, 2], 4, [7, 7]),
    # [2, 3, 4] matched at 2 and 1 == 1 before it, then 9 != 8: 4 tokens match, 4 drafts of 7
    ([9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 4], 8, [5, 6, 8, 1]),
    ([1, 2, 3, 1, 2], 4, [3, 1]),  # the match starts the sequence: nothing before it to compare
    ([7, 1, 2, 3, 9, 7, 1, 2, 3], 2, [9, 7]),  # a long match: K is the cap
    ([1, 2, 3, 4], 3, []),
])
def test_propose_ngram_matched_cuts_drafts_to_the_match(tokens: list[int], k: int, want: list[int]) -> None:
    assert propose_ngram_matched(tokens, k, 1, 3) == want


def test_speculative_config_is_parsed_as_vllm_spells_it() -> None:
    parsed = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                     '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert parsed == SpeculativeConfig(3, 4, 2)
    assert SpeculativeConfig.parse(None) is None
    with pytest.raises(ValueError, match="only 'ngram', 'suffix' and 'draft_model'"):
        SpeculativeConfig.parse({"method": "eagle"})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        SpeculativeConfig.parse({"draft_model": "x"})


def small_vocab_run(config: SchedulerConfig, fails, vocab_size: int, eos_probability: float = 0.0) -> Run:
    """A scheduler + fake worker whose sampler draws from `vocab_size` tokens (drafts often hit)."""
    run = Run(config, fails, eos_probability)
    run.sampler = dataclasses.replace(run.sampler, vocab_size=vocab_size)
    run.worker.sampler = run.sampler
    return run


def samplable(sampling: SamplingParams, vocab_size: int) -> bool:
    """Whether the fake sampler has a token to give: it always bans EOS (EOS comes only through
    eos_probability) and bans the stop ids until min_tokens, and with every token of a tiny
    vocabulary banned its `while token in banned` never ends (vocab 3, stop ids {1, 2} and
    min_tokens >= 1 once hung the random-trace test below)."""
    banned = {EOS} | (set(sampling.stop_token_ids) if sampling.min_tokens > 0 else set())
    return not set(range(vocab_size)) <= banned


def repeating(rid: str, max_tokens: int) -> EngineRequest:
    prompt = [3, 1, 2, 3, 1, 2, 3, 1]
    return EngineRequest(RequestId(rid), tuple(prompt),
                         SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def test_drafts_are_accepted_on_a_small_vocabulary_and_streams_stay_exact() -> None:
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8,
                             max_num_batched_tokens=64, speculative=SPEC)
    run = small_vocab_run(config, lambda plan, result: False, 3)
    requests = [repeating(f"r{i}", 40) for i in range(3)]
    run.go([(0, r) for r in requests])
    for request in requests:
        assert run.streams[(request.request_id, 0)] == expected(run.sampler, request, 0)
    core = run.scheduler
    assert core.spec_num_drafts > 0 and 0 < core.spec_num_accepted_tokens <= core.spec_num_draft_tokens
    plans_with_drafts = sum(1 for plan, _, _ in run.steps if plan.draft_token_ids)
    assert plans_with_drafts > 0 and len(run.steps) < 3 * 40  # fewer steps than one token per step
    assert core.stats().num_used_blocks == 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.sampled_from([3, 5, 40]), st.integers(1, 4),
       st.sampled_from([(0.0, 0.0), (0.05, 0.0001), (0.01, 0.002), (0.001, 0.01)]))
def test_random_traces_with_speculation_keep_invariants_and_streams(method, trace, vocab, k, step_cost) -> None:
    config, requests, *_ = trace
    assume(all(samplable(request.sampling, vocab) for _, request in requests))
    # suffix: a shallow tree and a small cache, so that eviction and depth cuts take part too
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1, method=method,
                             suffix_decoding_max_tree_depth=6, suffix_decoding_max_cached_tokens=40)
    config = dataclasses.replace(config, speculative=spec)

    def timed(plan, result):  # step times a + b * tokens, so that the draft-length policy (spec_policy.py) takes part
        tokens = len(result.request_ids) + sum(map(len, plan.draft_token_ids.values()))
        result.forward_seconds = step_cost[0] + step_cost[1] * tokens

    run = run_trace(config, trace, vocab, timed)
    if method == "suffix":  # every sequence's own tree dropped; the cache within its bound
        suffix = run.scheduler._spec
        assert suffix.num_tracked == 0 and suffix.cache.num_tokens <= 40  # type: ignore[union-attr]


def test_a_probe_whose_target_preempts_itself_does_not_schedule_it_again() -> None:
    # Hypothesis found it: after a worker loss the suspects run alone (poison.py); r2#2, probed
    # alone, found no free block, preempted itself, and the running loop (one step back, as for the
    # queue's list) met it again in the probe's own one-element list and scheduled it while the
    # same plan dropped it. The fake worker refuses tokens for a sequence it no longer holds.
    config = SchedulerConfig(num_blocks=17, block_size=4, max_model_len=40, max_num_seqs=6,
                             max_num_batched_tokens=12, long_prefill_token_threshold=7,
                             enable_prefix_caching=False, eos_token_ids=(EOS,),
                             speculative=SpeculativeConfig(num_speculative_tokens=1, prompt_lookup_max=3,
                                                           prompt_lookup_min=1))
    requests = [EngineRequest(RequestId(rid), prompt, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens))
                for rid, prompt, n, max_tokens in [("r0", (1, 1), 3, None), ("r1", (1, 1), 1, 1),
                                                   ("r2", (1, 1, 1, 1), 3, None)]]
    run = small_vocab_run(config, lambda plan, result: plan.step_id == 6 and not run.failures, 3)
    run.go([(0, r) for r in requests])
    assert run.failures == 1
    for request in requests:
        for index in range(request.sampling.n):
            assert run.streams[(request.request_id, index)] == expected(run.sampler, request, index)
    assert any(plan.preempted_ids for plan, _, _ in run.steps[6:])  # the self-preemption took place
    assert run.scheduler.stats().num_used_blocks == 0


def test_a_tiny_vocabulary_keeps_a_token_to_sample_or_the_trace_is_not_drawn() -> None:
    # The trace that hung: vocab 3 = {EOS=0, 1, 2}, stop ids {1, 2}, min_tokens 1: nothing to sample.
    assert not samplable(SamplingParams(min_tokens=1, stop_token_ids=(1, 2)), 3)
    assert samplable(SamplingParams(min_tokens=0, stop_token_ids=(1, 2)), 3)  # stop ids allowed
    assert samplable(SamplingParams(min_tokens=2, stop_token_ids=(1, 2)), 5)
    # One token left (2): it is what the first min_tokens tokens must be, speculation or not.
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=4,
                             max_num_batched_tokens=64, eos_token_ids=(EOS,), speculative=SPEC)
    request = EngineRequest(RequestId("r0"), (2, 1, 2, 1, 2),
                            SamplingParams(temperature=0.0, max_tokens=12, min_tokens=2, stop_token_ids=(1,)))
    assert samplable(request.sampling, 3)
    run = small_vocab_run(config, lambda plan, result: False, 3)
    run.go([(0, request)], max_steps=200)
    want = expected(run.sampler, request, 0)
    assert run.streams[("r0", 0)] == want and want[:2] == [2, 2]
    assert run.scheduler.stats().num_used_blocks == 0


def test_the_scheduler_flag_parses_vllms_json_and_refuses_bad_json(capsys) -> None:
    from scheduler_svc.__main__ import build_config, parse_args

    args = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert build_config(args).speculative == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", "{not json"])
    assert "bad --speculative-config" in capsys.readouterr().err


def test_drafts_never_take_a_step_past_its_token_budget() -> None:
    # Three drafting sequences and a budget of 4 tokens: the first takes 1 + up to 3, the others
    # must then decode plainly or wait (a regression: an exhausted budget once meant "all drafts").
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=4,
                             max_num_batched_tokens=4, long_prefill_token_threshold=4, speculative=SPEC)
    run = small_vocab_run(config, lambda plan, result: False, 3)
    requests = [repeating(f"r{i}", 24) for i in range(3)]
    run.go([(0, r) for r in requests], max_steps=400)
    for request in requests:
        assert run.streams[(request.request_id, 0)] == expected(run.sampler, request, 0)
    for plan, result, _ in run.steps:
        drafts = sum(map(len, plan.draft_token_ids.values()))
        assert len(result.request_ids) - drafts <= 4 and drafts <= 3, plan


def test_the_fake_sampler_refuses_a_vocabulary_with_every_token_banned():
    """It once looped forever here (the random-trace test hung on a replayed example)."""
    sampler = FakeSampler(vocab_size=3, eos_token_id=0)
    with pytest.raises(ValueError, match="every token"):
        sampler.sample(1, 0, 0, SamplingParams(min_tokens=1, stop_token_ids=(1, 2)))
    assert sampler.sample(1, 0, 1, SamplingParams(min_tokens=1, stop_token_ids=(1, 2))) in (1, 2)


def _decoding(seq_id: str, tokens: list[int]):
    """The fields `Speculator.propose` reads of a decoding sequence (its last token known)."""
    from types import SimpleNamespace
    request = SimpleNamespace(max_num_tokens=100, num_prompt_tokens=3, sampling=SimpleNamespace(logprobs=None),
                              beam=None)
    return SimpleNamespace(seq_id=seq_id, token_ids=tokens, num_placeholders=0, num_computed_tokens=len(tokens) - 1,
                           spec_accepts=0.0, spec_tries=0.0, request=request)


def test_ngram_drafts_are_cut_to_their_match_unless_the_sequence_runs_alone() -> None:
    """Alone, a step is bound by reading the weights and drafts past the match are nearly free
    (prompt lookup's K); beside others each draft costs about a decode row (cut to the match)."""
    from scheduler_svc.core.spec.ngram import NgramSpeculator

    speculator = NgramSpeculator(SPEC, kv=None, threshold=0)  # type: ignore[arg-type]
    tokens = [5, 1, 2, 7, 7, 1, 2]  # [1, 2] matched: prompt lookup drafts 4, the match earns 2
    assert speculator.propose([_decoding("a", tokens)]) == {"a": [7, 7, 1, 2]}
    assert speculator.propose([_decoding("a", tokens), _decoding("b", [1, 2, 3])]) == {"a": [7, 7]}


def run_trace(config, trace, vocab: int, on_step=None):
    """Run a hypothesis trace on the small-vocabulary fake worker under `config`: its aborts at
    their steps, a worker loss (as a failed step) once at its step, `on_step(plan, result)` on
    every step. Every stream must be the fake model's and the pool must end empty. The run."""
    _, requests, aborts, eos_probability, worker_loss_step = trace
    lost = []

    def loses_worker(plan, result):
        if on_step is not None:
            on_step(plan, result)
        if worker_loss_step is not None and plan.step_id == worker_loss_step and not lost:
            lost.append(plan.step_id)
            return True
        return False

    run = small_vocab_run(config, loses_worker, vocab, eos_probability)
    run.go(requests, [(at, requests[i][1].request_id) for at, i in aborts])
    assert_streams(run, requests)
    stats = run.scheduler.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
    return run


def assert_streams(run, requests) -> None:
    """Every sequence ended; what it streamed is the fake model's sequence (a prefix of it when
    aborted or failed): speculation, aborts and losses changed no token."""
    for _, request in requests:
        for index in range(request.sampling.n):
            key = (request.request_id, index)
            assert key in run.ended, f"{key} never ended"
            got, want = run.streams.get(key, []), expected(run.sampler, request, index)
            if run.ended[key] in (FinishReason.ABORT, FinishReason.ERROR):
                assert got == want[:len(got)], f"{key}: {got} is not a prefix of {want}"
            else:
                assert got == want, f"{key}: got {got}, expected {want}"
