"""Prompt lookup over the batch (scheduler_svc/core/spec/batch_lookup.py): exact drafts from the
other running sequences' outputs, their entries gone when they end; and the n-gram proposer taking
them only over a longer match of the sequence's own."""

from __future__ import annotations

from types import SimpleNamespace

from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.spec.batch_lookup import BatchLookup
from scheduler_svc.core.spec.ngram import NgramSpeculator


def seq(seq_id: str, prompt: list[int], output: list[int], tenant: str | None = None):
    """The fields the batch lookup and `Speculator.propose` read of a decoding sequence."""
    request = SimpleNamespace(max_num_tokens=100, num_prompt_tokens=len(prompt),
                              sampling=SimpleNamespace(logprobs=None), beam=None, tenant=tenant,
                              cache_salt=None)
    tokens = prompt + output
    return SimpleNamespace(seq_id=seq_id, token_ids=tokens, num_placeholders=0,
                           num_computed_tokens=len(tokens) - 1, spec_accepts=0.0, spec_tries=0.0, request=request)


def test_drafts_follow_a_batch_mates_output_cut_to_the_match() -> None:
    index = BatchLookup(n=4)
    ahead = seq("ahead", [90, 91], [7, 8, 1, 2, 3, 4, 5, 6, 9, 10, 11])
    behind = seq("behind", [80, 81], [6, 8, 1, 2, 3, 4])  # its last 4 tokens: ahead's, 5 counted back
    for s in (ahead, behind):
        index.index(s)
    assert index.lookup(behind, 8) == ([5, 6, 9, 10, 11], 5)  # what followed, no more than the match
    assert index.lookup(behind, 3) == ([5, 6, 9], 4)
    # the sequence's own tail is not a source, nor a mate's n-gram with nothing after it yet
    assert index.lookup(ahead, 8) == ([], 0)
    index.index(seq("other", [1], [2, 9, 10, 11]))  # ahead's last 4 tokens, at its end: nothing follows
    assert index.lookup(ahead, 8) == ([], 0)
    # only outputs are indexed: a prompt holding the n-gram is no source
    index.index(seq("prompted", [3, 8, 1, 2, 3, 4, 42], [43]))
    assert index.lookup(behind, 8) == ([5, 6, 9, 10, 11], 5)


def test_new_tokens_are_indexed_as_they_come_and_a_finished_sequence_leaves_nothing() -> None:
    index = BatchLookup(n=2, window=4)
    ahead = seq("ahead", [0], [1, 2])
    behind = seq("behind", [0], [5, 1, 2])
    index.index(ahead)
    index.index(behind)
    assert index.lookup(behind, 4) == ([], 0)  # [1, 2] ends ahead's output: nothing follows yet
    ahead.token_ids += [3, 4, 5, 6, 7]
    index.index(ahead)
    assert index.lookup(behind, 4) == ([], 0)  # [1, 2] slid out of ahead's 4-token window
    behind.token_ids += [3, 4]  # [3, 4] is in it, and [1, 2] before it matches too: 4 counted back
    assert index.lookup(behind, 4) == ([5, 6, 7], 4)
    index.drop(ahead)
    assert index.lookup(behind, 4) == ([], 0)
    index.index(behind)
    index.drop(behind)
    assert not index._where and not index._seqs and not index._next_end


def test_the_proposer_takes_a_mates_drafts_only_over_a_longer_own_match() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2)
    ahead = seq("ahead", [50, 51], [20, 21, 22, 23, 24, 25, 26])
    behind = seq("behind", [60, 21, 22, 99, 61], [20, 21, 22])  # own match [21, 22]: 2 tokens
    proposer = NgramSpeculator(spec, kv=None, threshold=0)  # type: ignore[arg-type]
    # the mate matches [20, 21, 22] (3): its drafts, cut to 3
    assert proposer.propose([ahead, behind])["behind"] == [23, 24, 25]
    off = NgramSpeculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2,
                                            prompt_lookup_batch=False), kv=None, threshold=0)  # type: ignore[arg-type]
    assert off.propose([ahead, behind])["behind"] == [99, 61]  # its own: cut to its 2-token match
    proposer.finished(ahead)
    assert proposer.propose([behind]) == {"behind": [99, 61, 20, 21]}  # alone: its own, uncut


def test_another_tenants_output_is_no_source() -> None:
    """Drafts from another tenant's answers would let a tenant time its way to them."""
    index = BatchLookup(n=4)
    theirs = seq("theirs", [90], [1, 2, 3, 4, 5, 6], tenant="b")
    mine = seq("mine", [80], [9, 1, 2, 3, 4], tenant="a")
    same = seq("same", [70], [1, 2, 3, 4, 7, 8], tenant="a")
    index.index(theirs)
    index.index(mine)
    assert index.lookup(mine, 4) == ([], 0)
    index.index(same)
    assert index.lookup(mine, 4) == ([7, 8], 4)
    same.request.cache_salt = "private"  # a salted request is as isolated as in the prefix cache
    assert index.lookup(mine, 4) == ([], 0)
