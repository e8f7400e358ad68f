"""The rejection rule of speculative sampling (worker_svc/spec_rejection.py), tested as the pure
function it is: over 20,000 generations on a 6-token vocabulary, with temperature 1.0 and top-p 0.9
applied to both the target's and the draft's logits by the sampler (so the two distributions
have zeros in different places), every emitted position is distributed as the target's p
(chi-square, p-value > 0.01), and the first draft is kept at the rate theory says, sum min(p, q).
"""

from __future__ import annotations

import torch

from pagoda.contract.params import SamplingParams
from worker_svc.sampler import Sampler, SamplingRow
from worker_svc.spec_rejection import accept_drafts

VOCAB, K, POSITIONS, DRAWS = 6, 2, 3, 20_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs, over the tokens probs gives mass to (a token of zero
    mass must never appear: asserted by the caller)."""
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    statistic = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _distributions(seed: int) -> torch.Tensor:
    """[POSITIONS + K, V]: one distribution per output position, as the sampler makes it."""
    logits = torch.randn(POSITIONS + K, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5
    row = SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), [], 0)
    probs = Sampler((), torch.device("cpu")).sampling_probs(logits, [row] * logits.shape[0])
    return probs.double()


def test_speculative_sampling_emits_the_targets_distribution() -> None:
    p, q = _distributions(1), _distributions(2)  # the target's, the draft's (another model)
    assert ((p == 0) != (q == 0)).any()  # top-p cut them differently: supports differ
    rng = torch.Generator().manual_seed(46)
    counts = torch.zeros(POSITIONS, VOCAB, dtype=torch.float64)
    first_kept = first_tried = 0
    for _ in range(DRAWS):
        emitted: list[int] = []
        while len(emitted) < POSITIONS:  # rounds of K drafts from where the output is
            at = len(emitted)
            drafts = [int(torch.multinomial(q[at + j], 1, generator=rng)) for j in range(K)]
            kept, final = accept_drafts(p[at:at + K + 1], q[at:at + K], drafts,
                                        lambda j: float(torch.rand(1, generator=rng, dtype=torch.float64)))
            if at == 0:
                first_tried += 1
                first_kept += kept > 0
            emitted += [*drafts[:kept], int(torch.multinomial(final, 1, generator=rng))]
        for position in range(POSITIONS):
            counts[position, emitted[position]] += 1
    for position in range(POSITIONS):
        assert (counts[position][p[position] == 0] == 0).all(), "a token the target cannot emit"
        assert chi_square_p_value(counts[position], p[position]) > 0.01, (position, counts[position], p[position])
    theory = float(torch.minimum(p[0], q[0]).sum())
    rate = first_kept / first_tried
    assert abs(rate - theory) < 4 * (theory * (1 - theory) / first_tried) ** 0.5, (rate, theory)
    print(f"acceptance of the first draft: {rate:.3f} (theory {theory:.3f})")


def test_a_point_mass_draft_is_the_n_gram_rule() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    kept, final = accept_drafts(p, None, [1], lambda j: 0.29)  # u < p(1) = 0.3: kept
    assert kept == 1 and torch.equal(final, p[1])
    kept, final = accept_drafts(p, None, [1], lambda j: 0.31)  # rejected: p without the draft
    assert kept == 0 and torch.allclose(final, torch.tensor([0.5, 0.0, 0.2], dtype=torch.float64) / 0.7)


def test_a_draft_q_could_not_draw_is_never_kept_and_the_residual_is_max_p_minus_q() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.2, 0.8]], dtype=torch.float64)
    kept, final = accept_drafts(p, q, [2], lambda j: 0.0)  # p(2) = 0: rejected even at u = 0
    assert kept == 0 and torch.allclose(final, torch.tensor([0.5, 0.3, 0.0], dtype=torch.float64) / 0.8)
