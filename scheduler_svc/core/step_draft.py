"""The scheduler's bookkeeping for one step: the plan being drafted, and the steps still in flight."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.contract.step import StepPlan
from scheduler_svc.core.request import Sequence


@dataclass(slots=True)
class InflightStep:
    step_id: int
    # (seq, its generation, num_computed after the step) of the sequences whose step completes a
    # block they have not registered: the others have nothing to register when the step reports.
    computed: list[tuple[Sequence, int, int]]
    spec: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, generation, drafts)
    num_tokens: int = 0  # computed in the step, drafts included: the speculation policy's cost fit


@dataclass(slots=True)
class StepDraft:
    """What schedule() accumulates while it builds one plan (each sequence is committed, i.e.
    advanced, as soon as it is scheduled: the ones already scheduled are never preempted later)."""

    plan: StepPlan
    budget: int  # tokens left in this step
    block_size: int
    computed: list[tuple[Sequence, int, int]] = field(default_factory=list)
    fork_parents: list[Sequence] = field(default_factory=list)  # forked once admission is done
    spec: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, generation, drafts)
    num_scheduled: int = 0  # sequences
    num_prefill: int = 0  # tokens
    num_decode: int = 0  # sequences (one token each)
    blocks_short: bool = False  # a running beam group waits for deferred frees: admit nothing

    def commit(self, seq: Sequence, num_new: int) -> None:
        """Advance seq's num_computed by `num_new` scheduled tokens (tokens of in-flight steps count);
        add a placeholder if the step samples for it."""
        total = len(seq.token_ids) + seq.num_placeholders
        # A decode: one token past the prompt the client sent (a continuation's earlier output is
        # not prompt: computing its last token alone, after a migration's import, is a decode).
        if num_new == 1 and total > seq.request.worker_num_prompt_tokens:
            self.num_decode += 1
        else:
            self.num_prefill += num_new
        self.num_scheduled += 1
        end = seq.num_computed_tokens + num_new
        seq.num_computed_tokens = end
        if end // self.block_size > seq.num_registered_blocks:
            self.computed.append((seq, seq.generation, end))
        if end == total:  # it samples
            seq.num_placeholders += 1
            if seq.pending_fork:
                self.fork_parents.append(seq)


def register_after_abort(inflight: Iterable[InflightStep], seq: Sequence) -> None:
    """An aborted running sequence's in-flight steps still write its blocks, which stay held until
    the last of them reports (deferred free): let each step register what it computed when it
    reports, as if the sequence still ran, so those blocks go to the evictable LRU hashed, not to
    the free list. A client that retries the same prompt after giving up mid-prefill (Claude Code
    drops a stream silent for 300 s) then resumes from every block computed, as in vLLM, which
    caches blocks as they fill; without this each abort lost the chunks in flight (up to
    max_inflight_steps of them). The steps get a snapshot: the sequence's own table is emptied."""
    ghost = None
    for step in inflight:
        for i, (owner, generation, end) in enumerate(step.computed):
            if owner is seq and generation == seq.generation:
                if ghost is None:
                    ghost = Sequence(seq.seq_id, seq.seq_index, seq.request, list(seq.token_ids),
                                     seq.status, seq.num_computed_tokens, block_table=list(seq.block_table),
                                     block_hashes=list(seq.block_hashes),
                                     num_registered_blocks=seq.num_registered_blocks,
                                     last_serial=seq.last_serial, generation=generation)
                step.computed[i] = (ghost, generation, end)
