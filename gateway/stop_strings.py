"""Stop strings over a stream of text deltas: find the first match, hold back only what could
still become one, and trim the match from the output (unless it is to be included)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.contract.errors import InvalidRequestError

# Bounds on what one request may ask for: the matcher's work per delta grows with both.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def check_stop_strings(stops: Sequence[str]) -> None:
    """Raise InvalidRequestError (400 / INVALID_ARGUMENT) for too many or too long stop strings."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for stop in stops:
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}")


@dataclass(frozen=True, slots=True)
class StopCheck:
    text: str  # safe to emit now
    stop: str | None = None  # the stop string that matched; the sequence is finished


class StopStringMatcher:
    """Feed text deltas; each call returns the text that may be shown and whether a stop matched.

    Invariants: the text seen so far (`_tail` holds its last max_len-1 chars) contains no complete
    stop string; `_held` is the longest unemitted suffix that is a prefix of some stop string.
    """

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._tail = ""
        self._held = ""

    def feed(self, delta: str) -> StopCheck:
        if not self._stops:
            return StopCheck(delta)
        window = self._tail + delta
        unemitted_start = len(self._tail) - len(self._held)
        match = self._first_match(window)
        if match is not None:
            position, stop = match
            end = position + len(stop) if self._include else position
            self._held = ""
            return StopCheck(window[unemitted_start:max(end, unemitted_start)], stop)
        keep = 0 if self._include else self._partial_suffix_len(window)
        self._held = window[len(window) - keep:] if keep else ""
        self._tail = window[-(self._max_len - 1):] if self._max_len > 1 else ""
        return StopCheck(window[unemitted_start:len(window) - keep])

    def flush(self) -> str:
        """The sequence ended without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, window: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            position = window.find(stop)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _partial_suffix_len(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of a stop string."""
        for length in range(min(self._max_len - 1, len(window)), 0, -1):
            suffix = window[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
