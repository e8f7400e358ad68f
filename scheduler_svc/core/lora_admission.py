"""The LoRA rule of admission: at most `max_loras` distinct adapters among the running sequences.

Why: the worker has `max_loras` device slots and every resident sequence may be scheduled in the
same step, so the running set, not only one step, must fit them. A waiting sequence whose adapter
already runs always fits; one with a new adapter waits while all slots are taken.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.core.request import Sequence


def running_adapters(running: Iterable[Sequence]) -> set[str]:
    return {seq.request.lora_key for seq in running if seq.request.lora_key is not None}


def adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The adapters (by name, sorted) of `seqs`, for the stats."""
    return tuple(sorted({seq.request.lora.lora_name for seq in seqs if seq.request.lora is not None}))


def lora_fits(seq: Sequence, running: Iterable[Sequence], max_loras: int) -> bool:
    key = seq.request.lora_key
    if key is None:
        return True
    active = running_adapters(running)
    return key in active or len(active) < max_loras
