"""Poison isolation: a failing step never loops, and fails only the request that makes it fail.

A step whose forward pass or sampler raised (StepError INTERNAL) leaves the worker's state unknown,
so the engine resyncs as after a worker loss and every resident sequence recomputes. Without more,
a request that always crashes the model would crash every retry, forever, and take every request
batched with it along (issue 20: 66 resyncs in 12 s for one `presence_penalty`). So:

- a failed *mixed* step gives every request with a running sequence a strike, and those sequences
  become suspects;
- while there are suspects, every step is a *probe*: one suspect sequence alone (its recompute,
  chunked if long, up to the step that samples), one step in flight, every other resident sequence
  skipped with 0 tokens. A probe that samples a token clears its suspect; everyone else then runs
  batched again as before;
- a probe that fails convicts its request (it ran alone, and it already failed once batched): the
  request ends with ERROR, every other request keeps its tokens;
- the budget: a request that took part in `max_step_failures` failed steps is failed even when it
  never failed alone (a fault that only shows in a batch), so the loop is bounded by
  max_step_failures x (number of requests) failed steps whatever the worker does.

The Scheduler holds one PoisonIsolator: it owns the suspects, the probe in flight and the counters,
and decides who is convicted and who runs next; the scheduler builds the probe's plan (the per-step
path) and ends the convicted requests.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.contract.ids import RequestId
from scheduler_svc.core.request import Request, SeqStatus, Sequence


class PoisonIsolator:
    def __init__(self, max_step_failures: int) -> None:
        self._max_step_failures = max_step_failures
        self.suspects: set[RequestId] = set()  # sequence ids to run alone before they batch again
        self.probe: tuple[int, Sequence] | None = None  # (step id, suspect) of the probe in flight
        self.num_step_failures = 0  # failed steps reported to blame()
        self.num_requests_isolated = 0  # requests failed by it

    def blame(self, step_id: int, running: list[Sequence]) -> list[Request]:
        """Step `step_id` failed: strike the requests that took part (the probe's alone when it was
        the probe); the convicted are returned (the caller ends them), the rest become suspects."""
        self.num_step_failures += 1
        probe, self.probe = self.probe, None
        solo = probe is not None and probe[0] == step_id and probe[1].status is SeqStatus.RUNNING
        blamed: dict[str, Request] = {}
        for seq in ([probe[1]] if solo else running):  # type: ignore[index]  # solo: a probe
            blamed.setdefault(seq.request.request_id, seq.request)
        convicted = []
        for req in blamed.values():
            req.num_step_failures += 1
            if solo or req.num_step_failures >= self._max_step_failures:
                self.num_requests_isolated += 1
                convicted.append(req)
            else:
                self.suspects.update(seq.seq_id for seq in req.seqs if seq.status is SeqStatus.RUNNING)
        return convicted

    def target(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> Sequence | None:
        """The suspect to probe next: the first running one, else the first waiting one."""
        suspects = self.suspects
        target = next((s for s in running if s.seq_id in suspects), None) or \
            next((s for s in waiting if s.seq_id in suspects), None)
        if target is None:  # (every suspect ended: the scheduler discards them; defensive)
            suspects.clear()
        return target

    def reported(self, step_id: int, request_ids: list[RequestId]) -> None:
        """A step reported: if it was the probe and its suspect sampled, it can batch again."""
        probe_step, target = self.probe  # type: ignore[misc]  # called while a probe is out
        if probe_step != step_id:
            return
        self.probe = None
        if target.seq_id in request_ids:
            self.suspects.discard(target.seq_id)

    def reset(self) -> None:
        """Everything ended (fail_all): nothing left to suspect."""
        self.suspects.clear()
        self.probe = None
