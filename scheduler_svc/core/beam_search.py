"""Beam search's ranking, as HF transformers does it (`generate(num_beams=W, do_sample=False,
early_stopping=True)`), over the candidates the worker reports. Pure: no blocks, no sequences.

One step, for a request whose W live beams each reported their K best next tokens (K =
num_beam_candidates: 2W, or more with several stop tokens):
- every candidate scores beam.cum_logprob + logprob; the K best of the union are kept, best first;
- a candidate that ends its beam (a stop token, or the length limit) becomes a finished hypothesis
  if it is among the W best of those K and the W finished slots are not all taken yet; its score is
  cum_logprob / (output length ** length_penalty), the output length counting the stop token;
  the finished keep the W best scores;
- the W best candidates that do not end become the next beams (a parent may have several children,
  or none: the scheduler re-points block tables accordingly, sharing blocks, no recomputation);
- the search is done when W hypotheses are finished (early_stopping=True), or when every kept
  candidate ended (the length limit).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from pagoda.contract.params import FinishReason

Candidate = tuple[int, float]  # (token id, raw logprob)


@dataclass(slots=True, frozen=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop token included), ranked by `score`."""

    token_ids: tuple[int, ...]
    cum_logprob: float
    score: float
    finish_reason: FinishReason


@dataclass(slots=True, frozen=True)
class NextBeam:
    parent: int  # index of the beam it extends
    token_id: int
    cum_logprob: float


@dataclass(slots=True)
class BeamSearch:
    width: int
    length_penalty: float
    stop_token_ids: frozenset[int]
    num_candidates: int
    finished: list[Hypothesis] = field(default_factory=list)  # at most width, best first
    done: bool = False

    def step(self, outputs: list[list[int]], cum_logprobs: list[float],
             candidates: list[list[Candidate]], max_output_tokens: int) -> list[NextBeam]:
        """One step over the live beams (outputs so far, cumulative logprobs, their candidates);
        returns the next beams ([] once `done`)."""
        assert not self.done and len(outputs) == len(cum_logprobs) == len(candidates)
        length = len(outputs[0]) + 1  # every live beam has the same length (lockstep)
        at_limit = length >= max_output_tokens
        scored = ((cum + logprob, beam, token)
                  for beam, (cum, cands) in enumerate(zip(cum_logprobs, candidates, strict=True))
                  for token, logprob in cands)
        # Best first; equal scores keep the order of beams, then of candidates (as topk tends to).
        kept = heapq.nlargest(self.num_candidates, scored, key=lambda c: c[0])
        ends = [at_limit or token in self.stop_token_ids for _, _, token in kept]
        was_full = len(self.finished) >= self.width
        new: list[Hypothesis] = []
        for rank, ((cum, beam, token), ended) in enumerate(zip(kept, ends, strict=True)):
            if ended and rank < self.width and not was_full:
                reason = FinishReason.STOP if token in self.stop_token_ids else FinishReason.LENGTH
                new.append(Hypothesis((*outputs[beam], token), cum,
                                      cum / (length ** self.length_penalty), reason))
        if new:
            merged = sorted((*self.finished, *new), key=lambda h: -h.score)
            self.finished = merged[: self.width]
        nexts = [NextBeam(beam, token, cum)
                 for (cum, beam, token), ended in zip(kept, ends, strict=True) if not ended]
        self.done = len(self.finished) >= self.width or not nexts
        return [] if self.done else nexts[: self.width]

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
