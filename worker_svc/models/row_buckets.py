"""The oneDNN-packed linears see a small, fixed set of row counts: inputs are padded up to a bucket.

Why (docs/reliability.md, "Worker memory"): oneDNN builds one primitive — a JIT-compiled kernel
with its own buffers, ~0.4 MiB — per GEMM shape, and the packed linears' M is the step's token
count, which changes nearly every step under load (decode batch sizes, prefill chunks, arrivals).
torch keeps those primitives in two LRU caches of 1,024 entries each (ideep's, sized by
`LRU_CACHE_CAPACITY`, and oneDNN's own, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`), so the worker's RSS grew
with every new shape until both were full (hundreds of MiB for SmolLM2's five GEMM shapes), then
kept creeping as evicted primitives were rebuilt into fragmented heaps; and each new shape cost a
JIT compile inside the step (milliseconds per linear). Padding M up to a bucket bounds the shapes,
so the caches hold every primitive the worker will ever need and never evict.

Buckets: every count up to 16 (decode batches; free to keep exact), then 8 per doubling (the
count rounded up to its 4 leading binary digits): at most 12.5% padded rows, ~4% on average. The
GEMMs of a decode step are bound by streaming the weights, so its padded rows cost next to
nothing; a prefill chunk pays the padding in compute. Up to 8,192 tokens that is 88 buckets.

The padded rows are zeros and their outputs are sliced off (a view): every real row's output is
the product oneDNN computes for it in a GEMM of the bucket's size.

`warm_row_buckets` builds every primitive the configured limits can reach at start (the worker's
first Init): left to the load, the buckets are met one by one as batch shapes vary, so the worker's
RSS steps up each time a rare one first comes (+25 MiB between requests 2,000 and 2,500 of a soak,
docs/reliability.md "RSS flat"), and that step's GEMMs pay the JIT compile.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
from torch import nn

from pagoda.runtime.math_utils import cdiv
from worker_svc.models.packed_linear import replace_modules

EXACT_UP_TO = 16  # row counts kept as they are
MANTISSA_BITS = 3  # buckets per doubling above EXACT_UP_TO: 2**MANTISSA_BITS


def bucket_rows(rows: int) -> int:
    """The smallest bucket >= rows (rows >= 0)."""
    if rows <= EXACT_UP_TO:
        return rows
    step = 1 << (rows.bit_length() - 1 - MANTISSA_BITS)
    return cdiv(rows, step) * step


def buckets_up_to(rows: int) -> list[int]:
    """Every bucket that a count in 1..rows maps to, ascending."""
    return sorted({bucket_rows(m) for m in range(1, rows + 1)})


class RowBucketedLinear(nn.Module):
    """`linear(x)` for x [..., in], computed over x's rows padded with zeros up to their bucket."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        rows = flat.shape[0]
        padded = bucket_rows(rows)
        if padded == rows:
            return self.linear(x)
        out = self.linear(nn.functional.pad(flat, (0, 0, 0, padded - rows)))  # [bucket, out]
        return out[:rows].view(*x.shape[:-1], out.shape[-1])


def bucket_linear_rows(model: nn.Module, kind: type[nn.Module]) -> int:
    """Wrap every `kind` module of `model` (the packed linears) in a RowBucketedLinear; returns
    how many were wrapped."""
    return replace_modules(model, kind, RowBucketedLinear)


@torch.inference_mode()
def warm_row_buckets(model: nn.Module, dtype: torch.dtype, max_rows: int, max_logit_rows: int) -> int:
    """Run each distinct bucketed linear shape of `model` once per bucket it can meet, so oneDNN
    builds (and caches) every primitive now: `max_rows` (a step's tokens) for the projections,
    `max_logit_rows` (the rows sampled in a step) for the lm_head. Returns the GEMMs run.

    The primitive cache is keyed by shapes and types, not by weights: one call per distinct
    (in, out, bias, rows) serves every layer. Rows past these limits (prompt logprobs, drafts)
    still build theirs when first met: bounded by the bucket count all the same."""
    lm_head = getattr(model, "lm_head", None)
    done: set[tuple[int, int, bool, int]] = set()
    for module in model.modules():
        if not isinstance(module, RowBucketedLinear):
            continue
        in_features, out_features = module.linear.in_features, module.linear.out_features
        limit = max_logit_rows if module is lm_head else max_rows
        for rows in buckets_up_to(limit):
            key = (in_features, out_features, module.bias is None, rows)
            if key not in done:
                done.add(key)
                module(torch.zeros(rows, in_features, dtype=dtype))  # [rows, in] -> [rows, out]
    return len(done)


def release_free_heap() -> bool:
    """Hand glibc's free heap back to the OS (malloc_trim(0)); False where there is no glibc.
    The warm-up's activations (up to max_rows x the widest projection) are freed when it ends, but
    glibc keeps the freed pages in its arenas: on SmolLM2 ~250 MiB of RSS the worker never uses."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return False
    return bool(trim(0)) if trim is not None else False
