"""Which waiting sequence admission tries next (`SchedulerConfig.admission_order`).

- "fcfs" (the default): the waiting queue's head (FCFS, or the priority heap's first).
- "cached-first": among the first `window` waiting sequences, the one with the fewest tokens left
  to compute after its prefix hit on every tier (device, host, disk). Why: a multi-turn session's
  next turn is mostly cached (a hit of its whole history, a few hundred new tokens), and under
  FCFS it waits behind other sessions' first turns, each a full prompt to prefill; run first, it
  costs those a step's share and answers in one step. What a production server wants for agents
  (docs/kv_tiers.md, "Benchmark"). Starvation is bounded: the head that another sequence
  overtook `max_overtakes` times is taken next whatever its length. With tenant fair share on
  (tenants.py) it chooses only among the waiting sequences of the tenant whose turn it is.

Lookups only (the prefix index and the tiers are read, nothing is touched): admission then looks
the chosen sequence's hit up again and admits it as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice

from scheduler_svc.core.request import Sequence

ADMISSION_ORDERS = ("fcfs", "cached-first")


class CachedFirst:
    """The "cached-first" choice, with the overtake count of the current head."""

    __slots__ = ("window", "max_overtakes", "_head", "_overtaken")

    def __init__(self, window: int = 32, max_overtakes: int = 16) -> None:
        self.window = window
        self.max_overtakes = max_overtakes
        self._head: Sequence | None = None
        self._overtaken = 0  # how many times another sequence went before `_head`

    def pick(self, waiting: Iterable[Sequence], head: Sequence, uncached: Callable[[Sequence], int]) -> Sequence:
        """The sequence to try next; `head` is the queue's own next, `uncached(seq)` the tokens
        `seq` would compute if admitted now."""
        if head is not self._head:
            self._head, self._overtaken = head, 0
        if self._overtaken >= self.max_overtakes:
            return head  # it has waited long enough
        best = min(islice(waiting, self.window), key=uncached)  # ties: the earlier in the queue
        if best is not head and uncached(best) < uncached(head):
            self._overtaken += 1
            return best
        return head
