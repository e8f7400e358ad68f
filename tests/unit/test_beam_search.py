"""Beam search's ranking (scheduler_svc/core/beam_search.py) on hand-computed cases; its
agreement with HF transformers on real models is tests/worker/test_beam_search_llm.py."""

from __future__ import annotations

import math

import pytest

from pagoda.contract.params import FinishReason
from scheduler_svc.core.beam_search import BeamSearch, NextBeam

EOS = 0


def search(width: int, length_penalty: float = 1.0) -> BeamSearch:
    return BeamSearch(width, length_penalty, frozenset({EOS}), num_candidates=2 * width)


def test_first_step_forks_the_best_candidates_of_the_one_beam():
    s = search(2)
    nexts = s.step([[]], [0.0], [[(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4)]], max_output_tokens=8)
    assert nexts == [NextBeam(0, 5, -0.1), NextBeam(0, 6, -0.2)]
    assert not s.done and not s.finished


def test_a_parent_may_get_two_children_and_another_none():
    s = search(2)
    nexts = s.step([[5], [6]], [-0.1, -0.2],
                   [[(1, -0.05), (2, -0.06), (3, -5.0), (4, -6.0)],
                    [(1, -3.0), (2, -4.0), (3, -5.0), (4, -6.0)]], max_output_tokens=8)
    assert [(n.parent, n.token_id) for n in nexts] == [(0, 1), (0, 2)]
    assert nexts[0].cum_logprob == pytest.approx(-0.15)


def test_a_stop_token_among_the_best_width_finishes_a_hypothesis_with_penalised_score():
    s = search(2, length_penalty=2.0)
    nexts = s.step([[5, 6], [7, 8]], [-1.0, -2.0],
                   [[(EOS, -0.5), (3, -1.0), (4, -1.5), (9, -9.0)],
                    [(3, -0.1), (EOS, -0.2), (4, -3.0), (9, -9.0)]], max_output_tokens=8)
    # ranked: EOS from beam 0 (-1.5), 3 from beam 0 (-2.0), 3 from beam 1 (-2.1), EOS from beam 1
    # (-2.2, rank 3: beyond the width, so not a hypothesis), ...
    assert s.finished[0].token_ids == (5, 6, EOS)
    assert s.finished[0].score == pytest.approx(-1.5 / 3**2)
    assert s.finished[0].finish_reason is FinishReason.STOP and len(s.finished) == 1
    assert [(n.parent, n.token_id) for n in nexts] == [(0, 3), (1, 3)]


def test_done_once_width_hypotheses_are_finished_and_they_are_sorted_by_score():
    s = search(2)
    s.step([[1], [2]], [-1.0, -1.1], [[(EOS, -0.1), (3, -0.2), (4, -5.0), (5, -6.0)],
                                      [(EOS, -0.3), (6, -0.4), (4, -5.0), (5, -6.0)]], max_output_tokens=8)
    # EOS(-1.1) and 3(-1.2) are the two best: only one hypothesis, the search goes on
    assert not s.done and len(s.finished) == 1
    nexts = s.step([[1, 3], [2, 6]], [-1.2, -1.5], [[(EOS, -0.01), (7, -2.0), (8, -3.0), (9, -4.0)],
                                                    [(EOS, -0.02), (7, -2.0), (8, -3.0), (9, -4.0)]],
                   max_output_tokens=8)
    assert s.done and nexts == []
    scores = [h.score for h in s.finished]
    assert scores == sorted(scores, reverse=True) and len(scores) == 2
    # (1, 3, EOS) -1.21/3 and (2, 6, EOS) -1.52/3 both beat the earlier (1, EOS) -1.1/2: it is dropped
    assert [h.token_ids for h in s.finished] == [(1, 3, EOS), (2, 6, EOS)]
    assert s.finished[0].score == pytest.approx(-1.21 / 3) and s.finished[1].score == pytest.approx(-1.52 / 3)


def test_the_length_limit_finishes_the_best_width_candidates():
    s = search(2)
    nexts = s.step([[1], [2]], [-1.0, -2.0], [[(3, -0.1), (4, -0.2), (5, -0.3), (6, -0.4)],
                                              [(3, -0.1), (4, -0.2), (5, -0.3), (6, -0.4)]],
                   max_output_tokens=2)
    assert s.done and nexts == []
    assert [(h.token_ids, h.finish_reason) for h in s.finished] == [((1, 3), FinishReason.LENGTH),
                                                                   ((1, 4), FinishReason.LENGTH)]
    assert s.finished[1].cum_logprob == pytest.approx(-1.2)
    assert math.isclose(s.finished[1].score, -1.2 / 2)
