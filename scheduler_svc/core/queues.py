"""Where every unfinished sequence is: waiting for admission, or running (resident on the worker).

Invariants (Scheduler.check_invariants tests them after every step in tests):
- every live (unfinished) sequence is in exactly one of `running` and `waiting`, with that status;
  a waiting sequence holds no device block, a finished one no block at all;
- `running_slots` is the sum of num_slots over `running` (a parent not forked yet reserves its
  children's slots) and never exceeds max_num_seqs;
- a request stays in `requests` until every one of its sequences has finished.
Order: running sequences in admission order (FCFS), or by `priority_key` ("priority"); a beam
group stays contiguous. Waiting: FCFS with preempted sequences at the front, or a priority heap.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, deque
from collections.abc import Iterator

from pagoda.contract.ids import RequestId
from scheduler_svc.core.request import NULL_BLOCK, Request, SeqStatus, Sequence


def priority_key(seq: Sequence) -> tuple[int, float, int, int]:
    """Lower runs first; ties by arrival time, then by arrival order, then by sequence index."""
    req = seq.request
    return (req.priority, req.arrival_time, req.arrival_order, seq.seq_index)


class WaitingQueue:
    """FCFS deque (preempted sequences go to the front), or a heap on (priority, arrival)."""

    __slots__ = ("_priority", "_deque", "_heap", "num_tokens")

    def __init__(self, policy: str) -> None:
        self._priority = policy == "priority"
        self._deque: deque[Sequence] = deque()
        self._heap: list[tuple[tuple[int, float, int, int], Sequence]] = []
        self.num_tokens = 0  # prompt tokens of the waiting sequences (the max_waiting_tokens bound)

    def __len__(self) -> int:
        return len(self._heap) if self._priority else len(self._deque)

    def __iter__(self) -> Iterator[Sequence]:
        if self._priority:
            return iter([seq for _, seq in sorted(self._heap, key=lambda e: e[0])])
        return iter(self._deque)

    def push_back(self, seq: Sequence) -> None:
        self.num_tokens += seq.request.num_prompt_tokens
        if self._priority:
            heapq.heappush(self._heap, (priority_key(seq), seq))
        else:
            self._deque.append(seq)

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: first in FCFS; in its (priority, arrival) place otherwise."""
        if self._priority:
            self.push_back(seq)
        else:
            self.num_tokens += seq.request.num_prompt_tokens
            self._deque.appendleft(seq)

    def peek(self) -> Sequence:
        return self._heap[0][1] if self._priority else self._deque[0]

    def pop(self) -> Sequence:
        seq = heapq.heappop(self._heap)[1] if self._priority else self._deque.popleft()
        self.num_tokens -= seq.request.num_prompt_tokens
        return seq

    def remove(self, seq: Sequence) -> None:
        if self._priority:
            self._heap = [e for e in self._heap if e[1] is not seq]
            heapq.heapify(self._heap)
        else:
            self._deque.remove(seq)
        self.num_tokens -= seq.request.num_prompt_tokens

    def clear(self) -> list[Sequence]:
        seqs = list(self)
        self._deque.clear()
        self._heap.clear()
        self.num_tokens = 0
        return seqs


class RunQueues:
    """The scheduler's shared bookkeeping of requests and sequences; its features get this object
    (not the Scheduler) when they move sequences between the queues."""

    __slots__ = ("requests", "live", "running", "running_slots", "waiting", "_priority")

    def __init__(self, policy: str) -> None:
        self.requests: dict[RequestId, Request] = {}
        self.live: dict[RequestId, Sequence] = {}  # unfinished sequences by sequence id
        self.running: list[Sequence] = []  # only ever changed in place: holders keep one list
        self.running_slots = 0  # sum of seq.num_slots over running
        self.waiting = WaitingQueue(policy)
        self._priority = policy == "priority"

    def add_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        self.running_slots += seq.num_slots
        if self._priority:
            bisect.insort(self.running, seq, key=priority_key)
        else:
            self.running.append(seq)

    def insert_running_after(self, seq: Sequence, after: Sequence) -> None:
        """Running, right behind `after` (a beam group stays contiguous)."""
        if self._priority:
            self.add_running(seq)  # the order key keeps a request's sequences together
            return
        seq.status = SeqStatus.RUNNING
        self.running_slots += seq.num_slots
        running = self.running
        index = len(running) - 1 if running[-1] is after else running.index(after)
        running.insert(index + 1, seq)

    def remove_running(self, seq: Sequence) -> None:
        running = self.running
        if running and running[-1] is seq:  # the usual victim: the tail
            running.pop()
        else:
            running.remove(seq)
        self.running_slots -= seq.num_slots

    def requeue_all(self) -> int:
        """A worker loss: every running sequence back to the front of the waiting queue (in running
        order), holding nothing; no in-flight token will arrive. Returns how many were running."""
        running = self.running
        for seq in reversed(running):  # reversed + push_front: running order is kept
            seq.block_table = []
            seq.num_computed_tokens = 0
            seq.num_registered_blocks = 0
            seq.num_window_freed = 0
            seq.last_serial = 0
            seq.generation += 1
            seq.resident = False
            seq.status = SeqStatus.WAITING
            self.waiting.push_front(seq)
        num_running = len(running)
        running.clear()
        self.running_slots = 0
        for seq in self.live.values():
            seq.num_placeholders = 0  # those tokens will never arrive; resuming recomputes them
        return num_running

    def check(self, block_size: int) -> Counter[int]:
        """Raise AssertionError when a sequence is misfiled; the running tables' block references."""
        refs: Counter[int] = Counter()
        for seq in self.running:
            if seq.status is not SeqStatus.RUNNING or self.live.get(seq.seq_id) is not seq:
                raise AssertionError(f"{seq.seq_id} is in the running list with status {seq.status}")
            freed, held = seq.block_table[:seq.num_window_freed], seq.block_table[seq.num_window_freed:]
            if len(set(held)) != len(held) or NULL_BLOCK in held or any(b != NULL_BLOCK for b in freed):
                raise AssertionError(f"{seq.seq_id} holds a block twice, or a freed one: {seq.block_table} "
                                     f"({seq.num_window_freed} freed out of the window)")
            if len(seq.block_table) * block_size < seq.num_computed_tokens:
                raise AssertionError(f"{seq.seq_id}: {seq.num_computed_tokens} computed tokens do not "
                                     f"fit its table {seq.block_table}")
            refs.update(held)
        for seq in self.waiting:
            if seq.block_table or seq.status is not SeqStatus.WAITING:
                raise AssertionError(f"waiting {seq.seq_id} holds blocks {seq.block_table}")
        for req in self.requests.values():
            for seq in req.seqs:
                if seq.status is SeqStatus.FINISHED and seq.block_table:
                    raise AssertionError(f"finished {seq.seq_id} still references {seq.block_table}")
        return refs

    def check_counts(self, max_num_seqs: int) -> None:
        if len(self.running) + len(self.waiting) != len(self.live):
            raise AssertionError(f"{len(self.live)} live sequences but {len(self.running)} running + "
                                 f"{len(self.waiting)} waiting")
        slots = sum(seq.num_slots for seq in self.running)
        if slots != self.running_slots or slots > max_num_seqs:
            raise AssertionError(f"running slots {self.running_slots} (recount {slots}) vs "
                                 f"max_num_seqs {max_num_seqs}")
