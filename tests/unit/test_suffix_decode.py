"""Suffix decoding's proposer (scheduler_svc/core/spec/suffix.py): exact drafts from the sequence's
own prompt + output, from other requests' cached outputs, of a length that grows with the match and
stops at the probability threshold; the output cache's bounds and eviction order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core import EngineRequest, SchedulerConfig
from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.spec.suffix import OutputCache, SuffixSpeculator, SuffixTree
from tests.unit.test_fake_worker_property import expected
from tests.unit.test_spec_decode import small_vocab_run


def speculator(**overrides) -> SuffixSpeculator:
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=8, **overrides)
    return SuffixSpeculator(config, None, 16)  # type: ignore[arg-type]  # (drafting needs no KV)


def seq(seq_id: str, tokens: list[int], num_prompt_tokens: int = 0) -> SimpleNamespace:
    """What drafting and finishing read of a Sequence."""
    return SimpleNamespace(seq_id=RequestId(seq_id), token_ids=list(tokens),
                           request=SimpleNamespace(beam=None, num_prompt_tokens=num_prompt_tokens))


def finish(spec: SuffixSpeculator, seq_id: str, prompt: list[int], output: list[int]) -> None:
    spec.finished(seq(seq_id, prompt + output, len(prompt)))  # type: ignore[arg-type]


@pytest.mark.parametrize(("tokens", "limit", "want"), [
    ([1, 2, 3, 4, 5, 1, 2, 3], 4, [4, 5, 1]),  # match [1, 2, 3]: 3 drafts at most (factor 1)
    ([1, 2, 3, 4, 5, 1, 2, 3], 2, [4, 5]),  # the step's limit
    ([7, 1, 2, 3, 4, 5, 6, 7, 1], 8, [2, 3]),  # a 2-token match ([7, 1]) earns 2 drafts
    ([1, 2, 3, 4], 4, []),  # nothing repeats
])
def test_prompt_internal_repeats(tokens, limit, want) -> None:
    assert speculator().draft(seq("r", tokens), limit) == want  # type: ignore[arg-type]


def test_the_draft_grows_with_the_matched_suffix() -> None:
    spec = speculator()
    finish(spec, "a", [50], [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Matched 1, 2, 3, 5 tokens of the cached output: that many drafts (factor 1), then the limit.
    assert spec.draft(seq("b", [40, 1]), 8) == [2]  # type: ignore[arg-type]
    assert spec.draft(seq("c", [40, 1, 2]), 8) == [3, 4]  # type: ignore[arg-type]
    assert spec.draft(seq("d", [40, 1, 2, 3]), 8) == [4, 5, 6]  # type: ignore[arg-type]
    assert spec.draft(seq("e", [1, 2, 3, 4, 5]), 3) == [6, 7, 8]  # type: ignore[arg-type]
    half = speculator(suffix_decoding_max_spec_factor=0.5)
    finish(half, "a", [50], [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert half.draft(seq("d", [40, 1, 2, 3, 4]), 8) == [5, 6]  # type: ignore[arg-type]


def test_a_continuation_seen_in_another_requests_output_is_proposed() -> None:
    spec = speculator()
    b = seq("b", [30, 20, 21])
    assert spec.draft(b, 4) == []  # type: ignore[arg-type]  # nothing cached yet, nothing repeats
    finish(spec, "a", [10, 11], [20, 21, 22, 23, 24, 25])
    assert spec.draft(b, 4) == [22, 23]  # type: ignore[arg-type]  # the cache changed: found now
    b.token_ids += [22]
    assert spec.draft(b, 4) == [23, 24, 25]  # type: ignore[arg-type]  # followed incrementally
    assert spec.draft(seq("c", [10, 11, 20]), 4) == [21]  # type: ignore[arg-type]  # prompts not cached


def test_the_probability_threshold_stops_the_draft() -> None:
    outputs = [[1, 2, 3, 4, 6], [1, 2, 3, 4, 6], [1, 2, 3, 5, 7]]  # after [1, 2, 3]: 4 (2/3), 5 (1/3)
    for min_prob, want in [(0.1, [4, 6]), (0.5, [4, 6]), (0.7, [])]:
        spec = speculator(suffix_decoding_min_token_prob=min_prob)
        for i, output in enumerate(outputs):
            finish(spec, f"o{i}", [90], output)
        assert spec.draft(seq("n", [9, 1, 2, 3]), 8) == want, min_prob  # type: ignore[arg-type]


def test_the_sequences_own_most_frequent_continuation_wins() -> None:
    # After [5]: 6 twice, 7 once in its own tokens: the draft follows 6.
    assert speculator().draft(seq("r", [5, 6, 1, 5, 7, 2, 5, 6, 3, 5]), 4) == [6]  # type: ignore[arg-type]


def dump(node) -> dict:
    return {t: (c.count, c.total, dump(c)) for t, c in node.children.items()}


def test_the_cache_keeps_its_token_budget_and_evicts_the_oldest() -> None:
    cache = OutputCache(depth=4, max_requests=10, max_tokens=10)
    outputs = {"a": (1, 2, 3, 4), "b": (5, 6, 7, 8), "c": (1, 2, 9, 9)}
    for key, tokens in outputs.items():
        cache.add(RequestId(key), tokens)
    assert cache.keys() == ["b", "c"] and cache.num_tokens == 8  # 12 > 10: "a", the oldest, went
    fresh = SuffixTree(4)
    fresh.insert(outputs["b"])
    fresh.insert(outputs["c"])
    assert dump(cache.tree.root) == dump(fresh.root)  # a's counts subtracted, its own nodes gone
    assert 3 not in cache.tree.root.children and cache.tree.root.children[1].count == 1
    cache.add(RequestId("d"), tuple(range(11)))  # longer than the whole budget: not cached
    assert cache.keys() == ["b", "c"]
    by_count = OutputCache(depth=4, max_requests=2, max_tokens=100)
    for key, tokens in outputs.items():
        by_count.add(RequestId(key), tokens)
    assert by_count.keys() == ["b", "c"]
    by_count.add(RequestId("b"), (7, 7))  # an id again: its new output, now the newest
    assert by_count.keys() == ["c", "b"] and by_count.num_tokens == 6
    for key in ["x", "y"]:
        by_count.add(RequestId(key), (1,))
    assert by_count.keys() == ["x", "y"] and by_count.num_tokens == 2 and dump(by_count.tree.root) == {1: (2, 0, {})}


def test_the_config_takes_suffix_and_its_keys() -> None:
    parsed = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 8, '
                                     '"suffix_decoding_max_cached_tokens": 1000}')
    assert parsed is not None and parsed.method == "suffix" and parsed.suffix_decoding_max_cached_tokens == 1000
    with pytest.raises(ValueError, match="min_token_prob"):
        SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=1.5)


def test_a_later_request_drafts_from_an_earlier_ones_output_in_the_scheduler() -> None:
    # Vocabulary 40 and a non-repeating prompt: prompt lookup has little to go on; the second request
    # (same prompt: the fake sampler gives it the same tokens) drafts from the first's cached output.
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=4,
                             max_num_batched_tokens=64, speculative=SpeculativeConfig(method="suffix",
                                                                                      num_speculative_tokens=6))
    prompt = (3, 9, 14, 27, 5)
    first, second = (EngineRequest(RequestId(rid), prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                                          ignore_eos=True)) for rid in ("r0", "r1"))
    run = small_vocab_run(config, lambda plan, result: False, 40)
    run.go([(0, first)])
    drafted_before = run.scheduler.spec_num_accepted_tokens
    steps_before = len(run.steps)
    run.go([(0, second)])
    for request in (first, second):
        assert run.streams[(request.request_id, 0)] == expected(run.sampler, request, 0)
    assert run.streams[("r0", 0)] == run.streams[("r1", 0)]
    assert run.scheduler.spec_num_accepted_tokens - drafted_before >= 20
    assert len(run.steps) - steps_before <= 12  # 30 tokens in far fewer than 30 steps
    assert run.scheduler._spec.num_tracked == 0  # type: ignore[union-attr]  # trees dropped at the end
    assert run.scheduler.stats().num_used_blocks == 0
