"""Which waiting sequence admission tries next (`SchedulerConfig.admission_order`).

- "auto" (the default): "cached-first" with a host KV tier (`num_offload_blocks` > 0), where a
  returning session's history is a hit whatever the device pool evicted; "fcfs" otherwise.
- "fcfs": the waiting queue's head (FCFS, or the priority heap's first).
- "cached-first": the earliest of the first `window` waiting sequences that has fewer tokens left
  to compute, after its prefix hit on every tier (device, host, disk), than the queue's head.
  Why: a multi-turn session's next turn is mostly cached (a hit of its whole history, a few
  hundred new tokens), and under FCFS it waits behind other sessions' first turns, each a full
  prompt to prefill. Served first, continuing sessions answer in seconds while new sessions wait
  for room: in a saturated closed loop (agents, chats) the sessions served at once settle to what
  the pool and the steps can hold, instead of every session queueing behind every other
  (SGLang's "lpm" orders by the same hit). The earliest, not the cheapest: among the turns that
  may pass the head, arrival order holds, so a turn with a little more to compute than the others
  is not passed over by each cheaper one that arrives after it. With tenant fair share on
  (tenants.py) it chooses only among the waiting sequences of the tenant whose turn it is.

Starvation is bounded in admissions: the queue's head is passed at most `max_overtakes` times,
then taken next whatever its length, so a sequence n-th in the queue is admitted within
n x (max_overtakes + 1) admissions. How the bound is counted matters as much as its size:
- A pass counts when the sequence picked over the head is admitted (`admitted`), not when it is
  picked. Why: a picked turn often waits some steps for room in the pool (admission stops there,
  in order); counted per pick, the head's bound ran out in that many steps and it went first anyway.
- Only the head counts. Why: the first turns of a burst of new sessions wait side by side; charged
  together at every pass they fall due together, then go one after the other while every later
  turn waits behind them: FCFS again. Counting the head alone lets a new session in at least
  every max_overtakes + 1 admissions, and at once whenever no cheaper turn waits.
(docs/kv_tiers.md, "Benchmark": the simulated 32-session workload, these rules against the others.)

Lookups only (the prefix index and the tiers are read, nothing is touched): admission then looks
the chosen sequence's hit up again and admits it as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice

from scheduler_svc.core.request import SeqStatus, Sequence

ADMISSION_ORDERS = ("auto", "fcfs", "cached-first")  # auto: cached-first with a host tier


class CachedFirst:
    """The "cached-first" choice, with the passes counted against each waiting head."""

    __slots__ = ("window", "max_overtakes", "_passed", "_picked")

    def __init__(self, window: int = 32, max_overtakes: int = 16) -> None:
        self.window = window
        self.max_overtakes = max_overtakes
        # id(head) -> (head, sequences admitted before it out of order): a head per tenant at most,
        # kept while it waits (the reference pins it, so its id cannot be reused meanwhile)
        self._passed: dict[int, tuple[Sequence, int]] = {}
        self._picked: tuple[Sequence, Sequence] | None = None  # (the last pick, the head it passes)

    def passes(self, head: Sequence) -> int:
        """Times a sequence behind `head` was admitted before it (0 once it stops being waited on)."""
        return self._passed.get(id(head), (head, 0))[1]

    def pick(self, waiting: Iterable[Sequence], head: Sequence, uncached: Callable[[Sequence], int]) -> Sequence:
        """The sequence to try next; `head` is the queue's own next, `uncached(seq)` the tokens
        `seq` would compute if admitted now."""
        self._picked = None
        if self.passes(head) >= self.max_overtakes:
            return head  # it has waited long enough
        head_cost = uncached(head)
        for seq in islice(waiting, self.window):  # prefix lookups on every tier: one per sequence
            if seq is head:  # by identity: a dataclass' == compares fields
                continue
            if uncached(seq) < head_cost:
                self._picked = (seq, head)
                return seq
        return head

    def admitted(self, seq: Sequence) -> None:
        """Admission took `seq` off the queue: when it was picked over the head, that head has been
        passed once more. Heads no longer waiting (admitted, aborted) are forgotten."""
        if self._picked is not None and self._picked[0] is seq:
            head = self._picked[1]
            self._passed[id(head)] = (head, self.passes(head) + 1)
        self._picked = None
        self._passed = {key: entry for key, entry in self._passed.items() if entry[0].status is SeqStatus.WAITING}
