"""A multimodal prompt's images as every service sees them (docs/vision.md), and their wire codec.

The gateway decodes and preprocesses each image with the model's HF processor and expands its
placeholder into `length` prompt tokens at `offset`; the scheduler treats those tokens like any other
(chunked prefill may cut through them) but keys prefix-cache blocks by the image hash too; the worker
encodes the pixels (once per hash, cached) and splices the embeddings in at the placeholder rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    hash: str  # hex SHA-256 of shape + pixel bytes: equal pixels, equal embeddings
    offset: int  # first placeholder token in the prompt
    length: int  # placeholder tokens = embedding rows the encoder yields
    pixel_values: bytes  # float32, C order
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.length


def content_hash(pixel_values: bytes, shape: Sequence[int]) -> str:
    digest = hashlib.sha256(repr(tuple(shape)).encode())
    digest.update(pixel_values)
    return digest.hexdigest()


def mm_block_keys(items: Sequence[MultiModalInput], block_index: int, block_size: int) -> tuple:
    """Extra hash keys of one KV block: ("mm", hash) of every image whose placeholder run overlaps it.
    The chain carries them to later blocks; blocks before the image are shared as text (vLLM's rule)."""
    if not items:
        return ()
    start, end = block_index * block_size, (block_index + 1) * block_size
    # offset + length, not .end: the gateway's router passes the wire's MultiModalInput messages
    return tuple(("mm", item.hash) for item in items if item.offset < end and item.offset + item.length > start)


def check_mm_inputs(items: Sequence[MultiModalInput], num_prompt_tokens: int) -> None:
    """ValueError unless the placeholder runs are in order, disjoint, non-empty and inside the prompt."""
    end = 0
    for item in items:
        if item.length <= 0 or item.offset < end or item.end > num_prompt_tokens:
            raise ValueError(f"image {item.hash[:12]} at [{item.offset}, {item.end}) is not a placeholder run "
                             f"inside the {num_prompt_tokens}-token prompt (in order, disjoint)")
        end = item.end
