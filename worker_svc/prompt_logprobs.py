"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): every prompt token's logprob, from
the prefill's hidden states.

Position p's logits are the distribution of token p+1. A step that computes positions
[start, start+n) of a prompt of P tokens therefore reports prompt tokens start+1 .. min(start+n,
P-1): under chunked prefill the last position of a chunk predicts the first token of the next one,
which the worker has (it holds the whole prompt). Position P-1 predicts the first *output* token:
that row is the sampler's, not a prompt logprob. A chunk that starts past 0 relies on the earlier
chunks having reported the tokens before it, which is why the scheduler gives such a request no
prefix-cache hit (there would be no logits for the cached positions).

Only the rows of requests that ask go through the LM head, a slice at a time, so a long chunk
never materialises [chunk, vocab] logits at once. Logprobs are the raw model's log-softmax in fp32
(vLLM's default "raw_logprobs"), as the sampler's for sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.contract.ids import RequestId
from pagoda.contract.step import PromptLogprobs, TokenLogprobs
from worker_svc.input_batch import ScheduledSeq

SLICE_ROWS = 512  # LM-head rows per pass: bounds the [rows, vocab] fp32 logits held at once


@dataclass(slots=True)
class PromptRows:
    """What one sequence's chunk reports: prompt tokens start .. start+len(rows)-1."""

    request_id: RequestId
    start: int  # index of the first prompt token covered (>= 1)
    rows: range  # flat hidden-state rows whose logits predict them
    targets: list[int]  # those prompt tokens
    top_k: int


def plan_prompt_rows(seqs: Sequence[ScheduledSeq], last_rows: np.ndarray) -> list[PromptRows]:
    """Before the step advances num_computed_tokens: the prompt tokens each asking sequence's
    chunk covers. `last_rows[i]` is the flat row of sequence i's last scheduled token."""
    plans: list[PromptRows] = []
    for i, seq in enumerate(seqs):  # every step, every sequence: the common case stays cheap
        state = seq.state
        top_k = state.sampling.prompt_logprobs
        if top_k is None:
            continue
        start = state.num_computed_tokens
        end = min(start + seq.num_tokens, state.num_prompt_tokens - 1)  # positions [start, end)
        if end <= start:
            continue  # decoding, or a chunk whose only prompt position is the sampling one
        first_row = int(last_rows[i]) - seq.num_tokens + 1
        plans.append(PromptRows(state.request_id, start + 1, range(first_row, first_row + end - start),
                                state.token_ids[start + 1:end + 1], top_k))
    return plans


@torch.inference_mode()
def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            hidden: torch.Tensor, plans: Sequence[PromptRows]) -> list[PromptLogprobs]:
    """hidden: [T, H] of the step's tokens. One PromptLogprobs per plan, in order."""
    if not plans:
        return []
    device = hidden.device
    rows = [r for plan in plans for r in plan.rows]
    targets = [t for plan in plans for t in plan.targets]
    max_k = max(plan.top_k for plan in plans)
    chosen: list[float] = []
    ranks: list[int] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    for lo in range(0, len(rows), SLICE_ROWS):
        index = torch.tensor(rows[lo:lo + SLICE_ROWS], dtype=torch.long, device=device)
        target = torch.tensor(targets[lo:lo + SLICE_ROWS], dtype=torch.long, device=device)
        logprobs = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)  # [R, V]
        picked = logprobs.gather(1, target[:, None])  # [R, 1]
        chosen += picked[:, 0].tolist()
        ranks += ((logprobs > picked).sum(dim=-1) + 1).tolist()  # [R]
        if max_k > 0:
            values, ids = logprobs.topk(max_k, dim=-1)  # [R, k], best first
            top_values += values.tolist()
            top_ids += ids.tolist()
    out: list[PromptLogprobs] = []
    i = 0
    for plan in plans:
        entries = []
        for _ in plan.rows:
            k = plan.top_k
            top = list(zip(top_ids[i][:k], top_values[i][:k], strict=True)) if k else []
            entries.append(TokenLogprobs(logprob=chosen[i], top=top, rank=ranks[i]))
            i += 1
        out.append(PromptLogprobs(plan.request_id, plan.start, entries))
    return out
