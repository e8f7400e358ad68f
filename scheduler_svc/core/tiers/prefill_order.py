"""Which waiting sequence admission tries next (`SchedulerConfig.admission_order`).

- "fcfs" (the default): the waiting queue's head (FCFS, or the priority heap's first).
- "cached-first": among the first `window` waiting sequences, the one with the fewest tokens left
  to compute after its prefix hit on every tier (device, host, disk). Why: a multi-turn session's
  next turn is mostly cached (a hit of its whole history, a few hundred new tokens), and under
  FCFS it waits behind other sessions' first turns, each a full prompt to prefill; run first, it
  costs those a step's share and answers in one step. What a production server wants for agents
  (docs/kv_tiers.md, "Benchmark"); SGLang's "lpm" policy orders by the same hit. Starvation is
  bounded for every waiting sequence: one that shorter sequences behind it overtook
  `max_overtakes` times is taken next whatever its length. With tenant fair share on
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
    """The "cached-first" choice, with the overtake counts of the sequences in its window."""

    __slots__ = ("window", "max_overtakes", "_overtaken")

    def __init__(self, window: int = 32, max_overtakes: int = 16) -> None:
        self.window = window
        self.max_overtakes = max_overtakes
        # id(seq) -> (seq, times a shorter sequence behind it went first); only the last window's
        # sequences are kept (the reference pins each one, so its id cannot be reused meanwhile)
        self._overtaken: dict[int, tuple[Sequence, int]] = {}

    def pick(self, waiting: Iterable[Sequence], head: Sequence, uncached: Callable[[Sequence], int]) -> Sequence:
        """The sequence to try next; `head` is the queue's own next, `uncached(seq)` the tokens
        `seq` would compute if admitted now."""
        window = list(islice(waiting, self.window))
        if not any(s is head for s in window):  # by identity: a dataclass' == compares fields
            window.insert(0, head)
        counts = {id(s): self._overtaken.get(id(s), (s, 0))[1] for s in window}
        self._overtaken = {id(s): (s, counts[id(s)]) for s in window}
        if counts[id(head)] >= self.max_overtakes:
            return head  # it has waited long enough
        # any other sequence passed over as often goes next, the earliest first: the bound holds
        # for every waiting request, not only for the head (a long turn just behind the head
        # would otherwise wait for as long as shorter ones keep arriving)
        due = next((s for s in window if counts[id(s)] >= self.max_overtakes), None)
        if due is not None:
            return due
        cost = {id(s): uncached(s) for s in window}  # prefix lookups on every tier: once each
        best = min(window, key=lambda s: cost[id(s)])  # ties: the earlier in the queue
        if best is head or cost[id(best)] >= cost[id(head)]:
            return head
        for s in window:  # everyone in front of `best` is overtaken once more
            if s is best:
                break
            self._overtaken[id(s)] = (s, counts[id(s)] + 1)
        return best
