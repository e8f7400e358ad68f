"""Speculative sampling's acceptance rule (Leviathan et al. 2023, Chen et al. 2023) as a pure function.

A draft token d drawn from the draft's distribution q is kept with probability min(1, p(d) / q(d)),
p the target's distribution at that position; at the first rejection the token is drawn instead
from the residual max(p - q, 0), renormalised; with every draft kept, from p after the last one.
Each emitted token is then distributed exactly as p, whatever q is, as long as q is the
distribution the draft really sampled from (so p and q must be processed alike for a high
acceptance rate, not for exactness). A proposer without a distribution (n-gram lookup, a greedy
draft) is the point mass q = 1 at d: kept with probability p(d), residual p without d.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def accept_drafts(p: torch.Tensor, q: torch.Tensor | None, drafts: Sequence[int],
                  uniform: Callable[[int], float]) -> tuple[int, torch.Tensor]:
    """p: [K+1, V] the target's sampling distributions (after the draft's j-th token at row j+1);
    q: [K, V] the draft's, or None for point masses; `uniform(j)`: the j-th acceptance uniform in
    [0, 1), drawn only as needed. Returns (drafts kept, the distribution [V] of the next token)."""
    for j, token in enumerate(drafts):
        p_token = float(p[j, token])
        q_token = 1.0 if q is None else float(q[j, token])
        # u < p/q, multiplied out: no division by a q(d) of 0 (a token q could not have drawn)
        if uniform(j) * q_token < p_token:
            continue
        if q is None:
            residual = p[j].clone()
            residual[token] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        total = float(residual.sum())
        # Only when p <= q everywhere (p == q): then d is always kept and this is unreachable but
        # for rounding; p itself is the right answer there.
        return j, (residual / total if total > 0.0 else p[j])
    return len(drafts), p[len(drafts)]
