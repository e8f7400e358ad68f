"""What a checkpoint the worker cannot serve raises, wherever it is found out (config or weights)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option this worker does not implement."""
