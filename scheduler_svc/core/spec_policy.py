"""How many drafts each sequence gets in a step: the count that maximises expected tokens per second.

Why not always K: a draft costs compute whether or not it is accepted. At batch 1 on CPU a step is
bound by reading the weights, so K more positions are almost free; at batch 8 the step already
computes 8 tokens and 8 x (1 + K) cost several times as much, so drafting all K can gain nothing
or lose (docs/speculative_decoding.md). The rule, after SmartSpec (Liu et al., 2024, "Optimizing
Speculative Decoding for Serving Large Language Models Using Goodput"):

- a step's time is modelled as a + b * tokens, fitted online to the times the worker reports.
  On CPU the real curve is not a line (oneDNN blocks rows: the quiet VM's thread-time curve
  rises 13 ms from 8 to 16 rows, 84 ms from 16 to 32, then stays flat to 48), and a policy that
  knew it would do 1-3% better on the forced copy task at batch 8 (`benchmarks.spec_sim
  --priced-by-curve`); but each row count's own recent average, learned online, was tried and
  dropped: on a shared machine a stall or two inflate the counts the policy then avoids, which
  are never timed again (drafts fell to 1.4 a drafted step, docs/speculative_decoding.md), where
  the line spreads every step over two coefficients;
- a sequence's j-th draft is accepted with probability alpha^j, alpha its own per-position
  acceptance rate (a prior for a new sequence), so its expected gain is alpha^j tokens. alpha
  follows the sequence's recent draft runs, not its whole life (`RECORD_DECAY`): an answer that
  copies a passage and then goes on in its own words drafts well, then badly, and a lifetime
  average would keep paying for full drafts long after the copy ended (at batch 8 each missed
  position costs about as much as a decode token);
- drafts are ranked best gain first, and the step takes the prefix of that ranking with the most
  expected tokens per second: (tokens it samples + gains) / t(rows). On a line t = a + b * M this
  is the first-refusal rule (a draft of gain g pays exactly when g * t(M) > G * b, and the gains
  fall while the bar rises); priced by a curve with flat stretches (the simulation's) it also
  looks past a dear step to the free ones after it.

Until the fit has seen enough steps of different sizes the policy grants every proposal (the fixed-K
behaviour), which is also what makes the sizes vary. Exactness never depends on this: the verifier
keeps outputs identical whatever the draft lengths.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

# alpha for a sequence with no history: Beta-like prior of PRIOR_ACCEPTS / PRIOR_TRIES
PRIOR_ACCEPTS, PRIOR_TRIES = 1.5, 2.0


def acceptance_rate(accepts: float, tries: float) -> float:
    """Per-position acceptance estimate from a sequence's record (see `update_record`), never below
    MIN_ALPHA: a sequence the policy stops drafting for is never verified again, so its estimate
    could not recover when its text turns copyable; where drafts are nearly free (batch 1 on CPU)
    the floor keeps it trying."""
    return max((accepts + PRIOR_ACCEPTS) / (tries + PRIOR_TRIES), MIN_ALPHA)


# Each verified draft run weighs this much less than the next: about the last 1 / (1 - 0.7) = 3 runs
# count. E.g. 9 runs of 4 drafts all accepted (a copy), then 5 runs whose first draft was rejected
# (the answer goes on in its own words): the lifetime rate is still (36 + 1.5) / (41 + 2) = 0.87,
# the decayed one 0.44 (and falling): where tokens are dear (batch 8) the later positions, worth
# alpha^j, fall under the bar first.
RECORD_DECAY = 0.7
MIN_ALPHA = 0.1


def update_record(accepts: float, tries: float, num_drafts: int, num_accepted: int) -> tuple[float, float]:
    """A sequence's record after one more verified run of `num_drafts` drafts of which
    `num_accepted` were accepted: the older runs and the prior decayed by RECORD_DECAY, this run's
    outcome added. The record is kept net of the prior (`acceptance_rate` adds it back), so a new
    sequence's is (0, 0) and the prior fades like any old run: a sequence whose drafts keep
    missing goes towards 0, not towards the prior."""
    new_accepts, new_tries = record_outcome(num_drafts, num_accepted)
    fade = 1.0 - RECORD_DECAY
    return (accepts * RECORD_DECAY + new_accepts - PRIOR_ACCEPTS * fade,
            tries * RECORD_DECAY + new_tries - PRIOR_TRIES * fade)


def record_outcome(num_drafts: int, num_accepted: int) -> tuple[int, int]:
    """(accepts, tries) one verified draft run adds: positions are tried in order until the first
    rejection, so `num_accepted` successes out of `num_accepted` + (1 if one was rejected) tries."""
    return num_accepted, num_accepted + (1 if num_accepted < num_drafts else 0)


@dataclass(slots=True)
class StepCostModel:
    """Least-squares fit of step seconds = a + b * tokens, with exponential forgetting so that the
    fit follows the machine (other load, thermal limits) over the last few hundred steps."""

    decay: float = 0.995
    min_steps: int = 16
    min_token_variance: float = 4.0  # tokens^2: below this the slope is not identified yet
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _steps: int = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0.0:
            return  # a step the worker did not time (tests' fake worker, an empty step)
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + num_tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + num_tokens * num_tokens
        self._xy = self._xy * d + num_tokens * seconds
        self._steps += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds per token; None while the fit is not identified."""
        if self._steps < self.min_steps:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < self.min_token_variance:
            return None
        b = max((self._xy / self._w - mean_x * mean_y) / var_x, 0.0)
        a = max(mean_y - b * mean_x, 0.0)
        return a, b


def choose_draft_lengths(proposed: dict[str, int], alphas: dict[str, float], base_tokens: int,
                         base_yield: int, cost: tuple[float, float] | Callable[[int], float]) -> dict[str, int]:
    """Drafts to keep per sequence (<= its proposal) for the highest expected tokens per second.

    `proposed`: seq -> drafts the proposer found; `alphas`: seq -> acceptance rate; `base_tokens`:
    tokens the step computes without drafts; `base_yield`: tokens it samples without drafts;
    `cost`: a line's (a, b) (`StepCostModel.coefficients`), or step seconds of a number of tokens.
    """
    if isinstance(cost, tuple):
        a, b = cost
        if b <= 0.0:
            return dict(proposed)  # drafts look free: take them all
        cost = lambda tokens: a + b * tokens  # noqa: E731
    # (-gain, seq, position): alpha^j falls with j, so a sequence's positions pop in order
    heap = [(-alphas[seq], seq, 1) for seq, n in proposed.items() if n > 0]
    heapq.heapify(heap)
    ranked: list[str] = []  # the drafts, best gain first
    expected = float(base_yield)
    base_cost = cost(base_tokens)
    if base_cost <= 0.0:
        return dict(proposed)  # an untimed step (its parts at 0): drafts look free
    best, best_n = expected / base_cost, 0
    while heap:
        neg_gain, seq, position = heapq.heappop(heap)
        ranked.append(seq)
        expected -= neg_gain
        seconds = cost(base_tokens + len(ranked))
        rate = expected / seconds if seconds > 0.0 else float("inf")
        if rate > best:
            best, best_n = rate, len(ranked)
        if position < proposed[seq]:
            heapq.heappush(heap, (neg_gain * alphas[seq], seq, position + 1))
    chosen = dict.fromkeys(proposed, 0)
    for seq in ranked[:best_n]:
        chosen[seq] += 1
    return chosen
