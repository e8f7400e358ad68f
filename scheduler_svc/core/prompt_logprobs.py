"""Prompt logprobs in the scheduler: gather the worker's per-chunk reports, hand them out once.

The worker reports each prefill chunk's prompt tokens (StepResult.prompt_logprobs). The request
keeps them in order (`Request.prompt_logprobs`) and, once complete, they ride on sequence 0's delta
with its first token: one list per request, whatever n. A request that recomputes its prompt
(preempted by recompute, a worker restart) is reported again for positions it already has: only
the positions past what it holds are kept, so nothing is handed out twice. Until complete, the
request gets no prefix-cache hit (kv_cache_manager.find_cached_prefix), so its reports always
start at token 1 and never leave a gap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagoda.contract.ids import RequestId
from pagoda.contract.step import PromptLogprobs
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.request import Request
from scheduler_svc.core.request import Sequence as Seq


def fold_prompt_logprobs(live: Mapping[RequestId, Seq], reports: Sequence[PromptLogprobs],
                         ready: dict[RequestId, Request]) -> None:
    """Append each report's new positions to its request; complete ones go into `ready`."""
    for report in reports:
        seq = live.get(report.request_id)
        if seq is None or not seq.request.needs_prompt_logprobs:
            continue  # finished, or a recomputation of what it already has
        req = seq.request
        held = req.prompt_logprobs
        assert held is not None
        owed = 1 + len(held)  # the index of the first prompt token it has no logprob for yet
        if report.start > owed:
            continue  # cannot follow what it holds (unreachable: reports start at token 1)
        held.extend(report.logprobs[owed - report.start:])
        if len(held) >= req.num_prompt_tokens - 1:
            ready[req.request_id] = req


def attach_prompt_logprobs(deltas: Sequence[SequenceDelta], ready: dict[RequestId, Request],
                           requests: Mapping[RequestId, Request]) -> None:
    """Put each ready request's prompt logprobs on its sequence 0's first-token delta; forget
    ready requests that ended without one (aborted)."""
    for delta in deltas:
        if delta.seq_index == 0 and delta.new_token_ids:
            req = ready.pop(delta.request_id, None)
            if req is not None:
                delta.prompt_logprobs = req.prompt_logprobs
    for request_id in [rid for rid in ready if rid not in requests]:
        del ready[request_id]
