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
    encoder_budget: int = 0  # image rows the worker may still encode this step (cut_for_encoder)
    encoder_full: int = 0  # the whole budget (--max-num-encoder-input-tokens)
    images: list[str] = field(default_factory=list)  # hashes of the images this step encodes (its span names them)

    def pay_encoder(self, seq: Sequence, start: int, num_new: int) -> None:
        """The images whose first token the scheduled chunk [start, start + num_new) holds: paid for."""
        for item in seq.request.mm_inputs:
            if start <= item.offset < start + num_new:
                self.encoder_budget -= item.length
                self.images.append(item.hash)

    def encoder_cut(self, seq: Sequence, start: int, num_new: int) -> tuple[int, int]:
        """(num_new cut before the first image this step's encoder budget cannot pay, the rows the
        rest costs): the caller pays (`pay_encoder`) once the chunk is scheduled."""
        if not seq.request.mm_inputs:
            return num_new, 0
        return cut_for_encoder(seq.request.mm_inputs, start, num_new, self.encoder_budget, self.encoder_full)

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


# The encoder budget (vLLM's `--max-num-encoder-input-tokens`): at most this many image embedding
# rows are encoded per step, so a burst of image prompts cannot stall a step behind the vision tower.
# A chunk that reaches the start of an image pays its rows (the worker encodes it then; its later
# chunks slice the cached embedding for free). When the step's budget cannot pay for an image, the
# chunk stops right before it; a chunk that would start at such an image waits for a later step,
# unless nothing was encoded yet this step (an image larger than the budget must still go through).
def cut_for_encoder(mm_inputs: tuple, start: int, num_new: int, budget: int, full: int) -> tuple[int, int]:
    """(tokens to schedule, encoder rows they cost) for a chunk [start, start + num_new) under
    `budget` rows left of `full`."""
    cost = 0
    for item in mm_inputs:
        if item.offset < start:
            continue  # already begun: its embedding is cached on the worker
        if item.offset >= start + num_new:
            break
        if cost + item.length > budget and not (budget == full and cost == 0):
            return item.offset - start, cost
        cost += item.length
    return num_new, cost


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
