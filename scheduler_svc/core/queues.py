"""Where every unfinished sequence is: waiting for admission, or running (resident on the worker).

Invariants (Scheduler.check_invariants tests them after every step in tests):
- every live (unfinished) sequence is in exactly one of `running` and `waiting`, with that status;
  a waiting sequence holds no device block, a finished one no block at all;
- `running_slots` is the sum of num_slots over `running` (a parent not forked yet reserves its
  children's slots) and never exceeds max_num_seqs;
- a request stays in `requests` until every one of its sequences has finished.
Order: running sequences in admission order (FCFS), or by `priority_key` ("priority"); a beam
group stays contiguous. Waiting: FCFS with preempted sequences at the front, or a priority heap,
in one lane per tenant (fair-share admission picks the lane, tenants.py).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, deque
from collections.abc import Callable, Container, Iterator

from pagoda.contract.ids import RequestId
from scheduler_svc.core.request import NULL_BLOCK, Request, SeqStatus, Sequence


def priority_key(seq: Sequence) -> tuple[int, float, int, int]:
    """Lower runs first; ties by arrival time, then by arrival order, then by sequence index."""
    req = seq.request
    return (req.priority, req.arrival_time, req.arrival_order, seq.seq_index)


class WaitingQueue:
    """FCFS (preempted sequences go to the front), or by (priority, arrival); one lane per tenant.

    Each sequence gets an order key: FCFS, a counter that grows at the back and shrinks at the
    front; "priority", priority_key. A lane holds one tenant's sequences in key order, so the
    queue's head is the lane head with the smallest key: with one tenant, exactly the old single
    queue. `peek` may rank the lanes first (fair share: the tenant with the smallest virtual token
    counter, tenants.py) and skip tenants (at their KV cap); within a lane the order is the policy's.
    """

    __slots__ = ("_priority", "_lanes", "_keys", "_front", "_back", "_len", "num_tokens")

    def __init__(self, policy: str) -> None:
        self._priority = policy == "priority"
        # tenant -> its sequences: a deque (FCFS, key order) or a heap of (priority_key, seq)
        self._lanes: dict[str, deque] = {}
        self._keys: dict[RequestId, int] = {}  # FCFS order keys by sequence id
        self._front, self._back, self._len = -1, 0, 0
        self.num_tokens = 0  # prompt tokens of the waiting sequences (the max_waiting_tokens bound)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        if len(self._lanes) == 1:
            (lane,) = self._lanes.values()
            return iter([e[1] for e in sorted(lane, key=lambda e: e[0])] if self._priority else list(lane))
        return iter(sorted((self._head_seq(e) for lane in self._lanes.values() for e in lane), key=self._key))

    def lengths(self) -> dict[str, int]:
        """Waiting sequences per tenant (tenants with none are absent)."""
        return {tenant: len(lane) for tenant, lane in self._lanes.items()}

    def _key(self, seq: Sequence):
        return priority_key(seq) if self._priority else self._keys[seq.seq_id]

    def _head_seq(self, entry) -> Sequence:
        return entry[1] if self._priority else entry

    def _lane(self, seq: Sequence) -> deque:
        lane = self._lanes.get(seq.request.tenant)
        if lane is None:
            lane = self._lanes[seq.request.tenant] = [] if self._priority else deque()  # type: ignore
        return lane

    def push_back(self, seq: Sequence) -> None:
        self.num_tokens += seq.request.num_prompt_tokens
        self._len += 1
        if self._priority:
            heapq.heappush(self._lane(seq), (priority_key(seq), seq))  # type: ignore[arg-type]
        else:
            self._keys[seq.seq_id] = self._back
            self._back += 1
            self._lane(seq).append(seq)

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: first in FCFS; in its (priority, arrival) place otherwise."""
        if self._priority:
            self.push_back(seq)
        else:
            self.num_tokens += seq.request.num_prompt_tokens
            self._len += 1
            self._keys[seq.seq_id] = self._front
            self._front -= 1
            self._lane(seq).appendleft(seq)

    def peek(self, rank: Callable[[str], float] | None = None,
             skip: Container[str] = ()) -> Sequence | None:
        """The next sequence to admit: the head of the lane whose (rank, head key) is smallest, of
        the tenants not in `skip` (without `rank`: by head key, the policy's order). None if none."""
        lanes = self._lanes
        if len(lanes) == 1 and not skip:
            return self._head_seq(next(iter(lanes.values()))[0])
        best, best_key = None, None
        for tenant, lane in lanes.items():
            if tenant in skip:
                continue
            head = self._head_seq(lane[0])
            key = (rank(tenant), self._key(head)) if rank is not None else self._key(head)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def pop(self) -> Sequence:
        seq = self.peek()
        assert seq is not None, "pop() from an empty waiting queue"
        self.remove(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        tenant = seq.request.tenant
        lane = self._lanes[tenant]
        if self._priority:
            if lane[0][1] is seq:
                heapq.heappop(lane)  # type: ignore[arg-type]
            else:
                lane[:] = [e for e in lane if e[1] is not seq]  # type: ignore[index]
                heapq.heapify(lane)  # type: ignore[arg-type]
        else:
            if lane[0] is seq:
                lane.popleft()
            else:
                lane.remove(seq)
            del self._keys[seq.seq_id]
        if not lane:
            del self._lanes[tenant]
        self._len -= 1
        self.num_tokens -= seq.request.num_prompt_tokens

    def clear(self) -> list[Sequence]:
        seqs = list(self)
        self._lanes.clear()
        self._keys.clear()
        self._len = 0
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
            seq.forget_draft()
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
            if len(set(seq.draft_table)) != len(seq.draft_table) or set(seq.draft_table) & set(held) \
                    or seq.draft_synced > len(seq.draft_table) \
                    or seq.draft_num_computed > min(seq.num_computed_tokens, len(seq.draft_table) * block_size):
                raise AssertionError(f"{seq.seq_id}: draft table {seq.draft_table} (synced "
                                     f"{seq.draft_synced}, {seq.draft_num_computed} computed) is off")
            refs.update(seq.draft_table)
        for seq in self.waiting:
            if seq.block_table or seq.draft_table or seq.status is not SeqStatus.WAITING:
                raise AssertionError(f"waiting {seq.seq_id} holds blocks {seq.block_table} {seq.draft_table}")
        for req in self.requests.values():
            for seq in req.seqs:
                if seq.status is SeqStatus.FINISHED and (seq.block_table or seq.draft_table):
                    raise AssertionError(f"finished {seq.seq_id} still references {seq.block_table} "
                                         f"{seq.draft_table}")
        return refs

    def check_counts(self, max_num_seqs: int) -> None:
        if len(self.running) + len(self.waiting) != len(self.live):
            raise AssertionError(f"{len(self.live)} live sequences but {len(self.running)} running + "
                                 f"{len(self.waiting)} waiting")
        slots = sum(seq.num_slots for seq in self.running)
        if slots != self.running_slots or slots > max_num_seqs:
            raise AssertionError(f"running slots {self.running_slots} (recount {slots}) vs "
                                 f"max_num_seqs {max_num_seqs}")
