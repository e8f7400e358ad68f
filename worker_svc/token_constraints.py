"""Token-level constraints a request puts on its logits: allowed_token_ids, bad_words, logit_bias.

Applied in place on logits [N, V], batched on the device: only the rows that ask take part, and
each kind is one indexed write over all of them (vLLM's logits processors, same order: allowed
ids, bad words, then the bias). Token ids outside the vocabulary are skipped (the gateway refuses
them; a direct caller must not crash the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pagoda.contract.params import SamplingParams


class Row(Protocol):
    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int


def apply_token_constraints(logits: torch.Tensor, rows: Sequence[Row]) -> None:
    """logits: [N, V], one row per entry of `rows`; edited in place."""
    vocab = logits.shape[1]
    device = logits.device
    _mask_disallowed(logits, rows, vocab, device)
    _ban_bad_words(logits, rows, vocab, device)
    _add_bias(logits, rows, vocab, device)


def _mask_disallowed(logits: torch.Tensor, rows: Sequence[Row], vocab: int, device: torch.device) -> None:
    constrained = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not constrained:
        return
    allowed = torch.zeros(len(constrained), vocab, dtype=torch.bool)  # [R, V]
    for j, i in enumerate(constrained):
        ids = [t for t in rows[i].params.allowed_token_ids if t < vocab]
        allowed[j, ids] = True
    index = torch.tensor(constrained, dtype=torch.long, device=device)
    logits[index] = logits[index].masked_fill(~allowed.to(device), float("-inf"))


def banned_bad_word_tokens(row: Row) -> list[int]:
    """The last token of every bad word whose earlier tokens end the output so far (vLLM's rule)."""
    output = row.token_ids[row.num_prompt_tokens:]
    banned = []
    for word in row.params.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or tuple(output[len(output) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def _ban_bad_words(logits: torch.Tensor, rows: Sequence[Row], vocab: int, device: torch.device) -> None:
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, row in enumerate(rows):
        if row.params.bad_words_token_ids:
            for token in banned_bad_word_tokens(row):
                if token < vocab:
                    row_idx.append(i)
                    col_idx.append(token)
    if row_idx:
        logits[_long(row_idx, device), _long(col_idx, device)] = float("-inf")


def _add_bias(logits: torch.Tensor, rows: Sequence[Row], vocab: int, device: torch.device) -> None:
    row_idx: list[int] = []
    col_idx: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            if token < vocab:
                row_idx.append(i)
                col_idx.append(token)
                biases.append(bias)
    if row_idx:
        values = torch.tensor(biases, dtype=logits.dtype, device=device)
        logits.index_put_((_long(row_idx, device), _long(col_idx, device)), values, accumulate=True)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
