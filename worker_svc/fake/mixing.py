"""The fake worker's deterministic "model": a hash of the history picks each token."""

from __future__ import annotations

_MASK = (1 << 64) - 1


def mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread deterministic hash of an int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)
