"""The encoder budget (vLLM's `--max-num-encoder-input-tokens`): at most this many image embedding
rows are encoded per step, so a burst of image prompts cannot stall a step behind the vision tower.

A chunk that reaches the start of an image pays its rows (the worker encodes it then, and its later
chunks slice the cached embedding for free). When the step's budget cannot pay for an image, the
chunk stops right before it; a chunk that would start at such an image waits for a later step,
unless nothing was encoded yet this step (an image larger than the budget must still go through).
"""

from __future__ import annotations

from collections.abc import Sequence


def cut_for_encoder(mm_inputs: Sequence, start: int, num_new: int, budget: int, full: int) -> tuple[int, int]:
    """(tokens to schedule, encoder rows they cost) for a chunk [start, start + num_new) under
    `budget` rows left of `full`."""
    cost = 0
    for item in mm_inputs:
        if item.offset < start:
            continue  # already begun: its embedding is cached on the worker
        if item.offset >= start + num_new:
            break
        if cost + item.length > budget and not (budget == full and cost == 0):
            return item.offset - start, cost
        cost += item.length
    return num_new, cost
