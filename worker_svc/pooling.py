"""Embeddings (SamplingParams.pooling): a prompt's final hidden states pooled into one vector.

`--pooling-type last` (the default, vLLM's for decoder models) takes the last prompt position's
final-normed hidden state; `mean` averages every prompt position's. Under chunked prefill each
chunk adds its positions to a running fp32 sum kept on the request's state, and the chunk that
completes the prompt reports the vector. The scheduler gives pooling requests no prefix-cache hit,
so every position is computed here and the sum never misses one (storing pooled sums alongside the
cache would be the alternative; skipping the hit costs only a prefill). A preempted request drops
its state and recomputes from position 0, sum included (the scheduler never swaps it out: the KV
alone would not restore the sum). The vector is L2-normalised unless
--no-normalize-embeddings, in fp32 whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np
import torch

from pagoda.contract.step import Embedding
from worker_svc.input_batch import ScheduledSeq

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)


def pool_embeddings(seqs: Sequence[ScheduledSeq], hidden: torch.Tensor, last_rows: np.ndarray,
                    pooling_type: str, normalize: bool) -> list[Embedding]:
    """Before the step advances num_computed_tokens: fold each pooling sequence's chunk (rows
    last-n+1 .. last of `hidden`) and report those whose prompt this chunk completes."""
    out: list[Embedding] = []
    for i, seq in enumerate(seqs):
        state = seq.state
        if not state.sampling.pooling:
            continue
        last = int(last_rows[i])
        if pooling_type == "mean":
            chunk = hidden[last - seq.num_tokens + 1:last + 1].float().sum(dim=0)
            state.pool_sum = chunk if state.pool_sum is None else state.pool_sum + chunk
        if state.num_computed_tokens + seq.num_tokens != len(state.token_ids):
            continue  # not the prompt's last chunk yet
        vector = (state.pool_sum / len(state.token_ids) if pooling_type == "mean"
                  else hidden[last].float())
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        out.append(Embedding(state.request_id, vector.cpu().tolist()))
    return out
