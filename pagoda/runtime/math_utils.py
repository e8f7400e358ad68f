"""Integer arithmetic every layer repeats: block counts, chunk counts, padded sizes."""

from __future__ import annotations


def cdiv(a, b):
    """Ceiling division of non-negative ints (or integer numpy arrays, elementwise): how many
    blocks of size `b` hold `a` items."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """The smallest multiple of `b` that is at least `a`."""
    return cdiv(a, b) * b
