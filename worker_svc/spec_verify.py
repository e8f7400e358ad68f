"""Verifying drafts on the worker: the output distribution is exactly the sampler's.

For a sequence with drafts d1..dK the model gave logits at K+1 positions: after its last token,
after d1, ..., after dK. Each position becomes a sampling row whose history includes the drafts
before it, so token constraints, min_tokens and penalties see what they would see without
speculation. Then, position by position:
- greedy rows accept d(j+1) while it is the argmax; the first mismatch's argmax (or, all accepted,
  the argmax after dK) is the bonus token: exactly the tokens plain greedy decoding produces;
- random rows use the rejection rule of speculative sampling (spec_rejection.py): accept d(j+1)
  with probability min(1, p(d)/q(d)); on the first rejection, sample from the residual
  max(p - q, 0) renormalised; all accepted: sample the bonus from p after dK. q is the draft
  model's distribution when it sampled the drafts, else a point mass (n-gram drafts, greedy
  drafts: q = 1 at d, so accept with probability p(d), residual p without d). Each emitted token
  is then distributed as p (Leviathan et al. 2023).
  A seeded row draws its acceptance uniforms and its sample from generators seeded by (seed,
  seq_index, output position), so its tokens depend on nothing else in the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from worker_svc.sampler import Sampler, SamplingRow, row_argmax
from worker_svc.spec_rejection import accept_drafts


def accept_seed(seed: int, seq_index: int, position: int) -> int:
    """The acceptance-uniform seed of a seeded row: independent of the sampling noise's seed."""
    digest = hashlib.blake2b(f"accept/{seed}/{seq_index}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class DraftVerifier:
    def __init__(self, sampler: Sampler, seed: int = 0) -> None:
        self.sampler = sampler
        self.generator = torch.Generator()  # CPU: the acceptance uniforms of unseeded rows
        self.generator.manual_seed(seed + 1)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, items: Sequence[tuple[SamplingRow, list[int]]],
                 draft_probs: Sequence[torch.Tensor | None] | None = None) -> list[list[int]]:
        """logits: [sum(K_i + 1), V], each item's K_i + 1 positions back to back (modified in
        place). items: (the row of the item's last real token, its drafts). draft_probs: per item,
        the [K_i, V] distributions a draft model sampled its drafts from, or None (point masses).
        Returns each item's tokens: the accepted drafts, then one token of its own."""
        rows = [SamplingRow(base.params, [*base.token_ids, *drafts[:j]], base.num_prompt_tokens,
                            base.seq_index, base.grammar)
                for base, drafts in items for j in range(len(drafts) + 1)]
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        self.sampler.adjust_logits(logits, rows)
        starts, offset = [], 0
        for _, drafts in items:
            starts.append(offset)
            offset += len(drafts) + 1
        results: list[list[int] | None] = [None] * len(items)
        greedy = [i for i, (base, _) in enumerate(items) if base.params.greedy]
        if greedy:
            argmax = row_argmax(logits).tolist()
            for i in greedy:
                results[i] = _greedy_run(items[i][1], argmax[starts[i]:starts[i] + len(items[i][1]) + 1])
        randoms = [i for i, (base, _) in enumerate(items) if not base.params.greedy]
        if randoms:
            qs = draft_probs if draft_probs is not None else [None] * len(items)
            self._sample_randoms(logits, rows, items, starts, randoms, results, qs)
        return results  # type: ignore[return-value]

    def _sample_randoms(self, logits: torch.Tensor, rows: list[SamplingRow], items, starts: list[int],
                        randoms: list[int], results: list, draft_probs) -> None:
        sampler, device = self.sampler, logits.device
        flat = [starts[i] + j for i in randoms for j in range(len(items[i][1]) + 1)]
        probs = sampler.sampling_probs(logits[torch.tensor(flat, device=device)], [rows[r] for r in flat])
        finals, final_rows = [], []  # the distribution each item's own token is drawn from
        at = 0
        for i in randoms:
            base, drafts = items[i]
            block = probs[at:at + len(drafts) + 1]  # [K+1, V]
            at += len(drafts) + 1
            q = draft_probs[i]
            accepted, final = accept_drafts(block, None if q is None else q.to(device), drafts,
                                            lambda j, base=base: self._uniform(base, base.num_output_tokens + j))
            finals.append(final)
            final_rows.append(rows[starts[i] + accepted])
            results[i] = list(drafts[:accepted])
        final_probs = torch.stack(finals)  # [R, V]
        noise = sampler._exponential_noise(final_rows, final_probs.shape[1])  # seeded per position
        for i, token in zip(randoms, (final_probs / noise).argmax(dim=-1).tolist(), strict=True):
            results[i].append(token)

    def _uniform(self, row: SamplingRow, position: int) -> float:
        if row.params.seed is None:
            return torch.rand(1, generator=self.generator).item()
        generator = torch.Generator()
        generator.manual_seed(accept_seed(row.params.seed, row.seq_index, position))
        return torch.rand(1, generator=generator).item()


def _greedy_run(drafts: list[int], argmax: list[int]) -> list[int]:
    """The drafts the argmaxes confirm, then the argmax after the last confirmed one."""
    for j, draft in enumerate(drafts):
        if argmax[j] != draft:
            return [*drafts[:j], argmax[j]]
    return [*drafts, argmax[len(drafts)]]
