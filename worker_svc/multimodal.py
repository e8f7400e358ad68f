"""Image embeddings into a step's input rows: encode (once per image hash), slice, splice.

A step computes rows [c, c + n) of each scheduled sequence. An image whose placeholder run
[offset, offset + length) overlaps that range contributes rows [max(c, offset), min(c + n, end)) of
its embedding, so chunked prefill may cut through an image: the next chunk slices the same cached
embedding further on. The cache is keyed by the image's content hash and bounded (LRU, in images):
a re-sent image, or a resumed preempted request, is not encoded again while it stays cached.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from pagoda.contract.multimodal import MultiModalInput
from pagoda.runtime.logging import get_logger
from worker_svc.input_batch import ScheduledSeq

log = get_logger(__name__)


class EncoderCache:
    """Image hash -> its embedding rows [length, hidden], least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_hits = 0  # lookups served from the cache
        self.num_encoded = 0  # images run through the encoder
        self.num_encoder_tokens = 0  # embedding rows they produced

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: str) -> torch.Tensor | None:
        rows = self._rows.get(key)
        if rows is not None:
            self._rows.move_to_end(key)
            self.num_hits += 1
        return rows

    def put(self, key: str, rows: torch.Tensor) -> None:
        self._rows[key] = rows
        self._rows.move_to_end(key)
        self.num_encoded += 1
        self.num_encoder_tokens += rows.shape[0]
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def clear(self) -> None:
        self._rows.clear()


class MultiModalEmbedder:
    """Owns the vision encoder (e.g. models/llava_vision.LlavaVision) and the encoder cache."""

    def __init__(self, vision, dtype: torch.dtype, device: torch.device, cache_size: int = 64) -> None:
        self.vision = vision
        self.dtype, self.device = dtype, device
        self.cache = EncoderCache(cache_size)
        self._reported = (0, 0)  # (encoder tokens, cache hits) at the last take_step_counts

    def take_step_counts(self) -> tuple[int, int]:
        """(encoder tokens, cache hits) since the last call: one step's, for its StepResult."""
        now = (self.cache.num_encoder_tokens, self.cache.num_hits)
        step = (now[0] - self._reported[0], now[1] - self._reported[1])
        self._reported = now
        return step

    def needed(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether any row of this step is an image placeholder."""
        return any(_overlapping(s) for s in seqs if s.state.mm_inputs)

    def splice(self, seqs: list[ScheduledSeq], embeds: torch.Tensor) -> None:
        """Overwrite the placeholder rows of `embeds` [T, hidden] (seqs back to back) in place."""
        row = 0
        for seq in seqs:
            start = seq.state.num_computed_tokens
            for item in _overlapping(seq):
                lo, hi = max(start, item.offset), min(start + seq.num_tokens, item.end)
                rows = self._embedding(item)  # [length, hidden]
                embeds[row + lo - start:row + hi - start] = rows[lo - item.offset:hi - item.offset]
            row += seq.num_tokens

    def _embedding(self, item: MultiModalInput) -> torch.Tensor:
        rows = self.cache.get(item.hash)
        if rows is not None:
            return rows
        pixels = np.frombuffer(item.pixel_values, dtype="<f4").reshape(item.shape)
        pixels_t = torch.from_numpy(pixels.copy()).to(self.device, self.dtype)
        rows = self.vision.encode(pixels_t.unsqueeze(0))[0]  # [tokens, hidden]
        if rows.shape[0] != item.length:
            raise ValueError(f"image {item.hash[:12]}: the encoder gave {rows.shape[0]} rows for "
                             f"{item.length} placeholder tokens (the gateway's processor disagrees)")
        self.cache.put(item.hash, rows)
        log.debug("image_encoded", image=item.hash[:12], tokens=item.length)
        return rows


def _overlapping(seq: ScheduledSeq) -> list[MultiModalInput]:
    start, end = seq.state.num_computed_tokens, seq.state.num_computed_tokens + seq.num_tokens
    return [m for m in seq.state.mm_inputs if m.offset < end and m.end > start]
