"""Speculative decoding, the scheduler's half: propose drafts, settle what the worker accepted;
and the n-gram proposer (the suffix proposer is suffix.py).

The proposer (prompt lookup): for a decoding sequence whose last token is known, find the most
recent earlier occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
in its own prompt + output, and propose the up to K tokens that followed it; beside others, also in
the other running sequences' outputs where they match longer (batch_lookup.py). Pure Python, no model.

How many of its drafts a sequence gets in a step is the goodput policy's call (spec_policy.py).
A sequence with drafts is scheduled 1 + K tokens (its last token, then the drafts) within the
step's token budget, with blocks for all of them. It is committed like a decode (one placeholder,
num_computed up to its last token, prefix blocks registered only up to there, so a rejected draft
never gets a hash). When the step reports 1 + a tokens for it (a drafts accepted, then the
worker's own token), `settle` advances num_computed by a and cuts the block table to the
blocks covering positions <= num_computed: blocks only rejected drafts touched go back to the pool.
The worker cuts its copy of the table by the same rule. Stop conditions were already applied token
by token by the scheduler's update(); a sequence that stopped inside the run is finished and
skipped here.

The Scheduler holds one Speculator (with speculation on; `make_speculator` in this package picks the
class by `method`): it owns the proposer's settings, the step-cost fit and the speculation counters,
and changes block tables only through the KV manager. A subclass only says what to draft for one
sequence (`draft`) and what to forget when a sequence ends (`finished`).
"""

from __future__ import annotations

from collections import Counter

from pagoda.contract.ids import RequestId
from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.request import SeqStatus, Sequence
from scheduler_svc.core.spec.batch_lookup import BatchLookup
from scheduler_svc.core.spec_policy import (
    StepCostModel,
    acceptance_rate,
    choose_draft_lengths,
    update_record,
)
from scheduler_svc.core.step_draft import StepDraft

SEARCH_WINDOW = 4096  # tokens searched back from the end: bounds the proposer's cost per sequence


def propose_ngram(tokens: list[int], max_drafts: int, n_min: int, n_max: int) -> list[int]:
    """Up to `max_drafts` tokens that followed the latest earlier match of the longest suffix n-gram
    (n_max >= n >= n_min) of `tokens`; [] when none matches."""
    found = _lookup(tokens, max_drafts, n_min, n_max)
    return [] if found is None else tokens[found[0] + found[1]:found[0] + found[1] + max_drafts]


def propose_ngram_matched(tokens: list[int], max_drafts: int, n_min: int, n_max: int) -> list[int]:
    """`propose_ngram`, its drafts cut to the length of the match: as many as the tokens before the
    match's source that still agree with the sequence's own (counted back from the n-gram's end,
    at least the n-gram). Why (issue 33, the forced copy task at batch 8): a long copy matches its source
    far back and keeps matching, while the text the model makes up after it matches only 2-4 common
    tokens somewhere, whose drafts mostly miss; where a draft position costs nearly a decode row
    (batch 8) the cut drops 96 of 524 draft rows a run, 15 of them accepted (simulated,
    docs/speculative_decoding.md).
    Suffix decoding caps its drafts the same way (`suffix_decoding_max_spec_factor` x match)."""
    return match_ngram(tokens, max_drafts, n_min, n_max)[0]


def match_ngram(tokens: list[int], max_drafts: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """(`propose_ngram_matched`'s drafts, the match's length counted up to max_drafts); ([], 0)."""
    found = _lookup(tokens, max_drafts, n_min, n_max)
    if found is None:
        return [], 0
    start, n = found
    matched, end = n, len(tokens)
    while matched < max_drafts and start - (matched - n) > 0 \
            and tokens[start - (matched - n) - 1] == tokens[end - matched - 1]:
        matched += 1
    return tokens[start + n:start + n + min(max_drafts, matched)], matched


def _lookup(tokens: list[int], max_drafts: int, n_min: int, n_max: int) -> tuple[int, int] | None:
    """(start, n) of the latest earlier occurrence of the longest suffix n-gram of `tokens`."""
    length = len(tokens)
    if max_drafts <= 0 or length <= n_min:
        return None
    lowest = max(0, length - SEARCH_WINDOW)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        first = suffix[0]
        # Scan starts right to left: the most recent occurrence usually predicts best.
        start = length - n - 1
        while start >= lowest:
            try:
                start = _rindex(tokens, first, lowest, start)
            except ValueError:
                break
            if tokens[start:start + n] == suffix:
                return start, n
            start -= 1
    return None


def _rindex(tokens: list[int], value: int, lo: int, hi: int) -> int:
    """The largest i in [lo, hi] with tokens[i] == value (ValueError if none)."""
    for i in range(hi, lo - 1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)


class Speculator:
    """What every proposer shares: which sequences may draft, the goodput cut, scheduling the
    drafts, settling what was accepted, the counters."""

    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager, threshold: int) -> None:
        self.config = config
        self._kv = kv
        self._threshold = threshold  # the scheduler's prefill chunk: the base cost of a step
        self.num_drafts = 0  # sequences-steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: Counter[int] = Counter()  # position i (0-based) accepted
        self._cost = StepCostModel()  # fitted to the worker's step times (spec_policy.py)
        self._alone = False  # this step's `propose` has one sequence running

    def observe_step_cost(self, num_tokens: int, seconds: float) -> None:
        self._cost.observe(num_tokens, seconds)

    @staticmethod
    def _may_draft(seq: Sequence, total: int) -> bool:
        """Decoding, its last token known, nothing in flight, no logprobs asked (drafts carry none)."""
        req = seq.request
        return total - seq.num_computed_tokens == 1 and not seq.num_placeholders \
            and total > req.num_prompt_tokens and req.sampling.logprobs is None and req.beam is None

    def propose(self, running: list[Sequence], after_step: int | None = None) -> dict[RequestId, list[int]]:
        """The proposer's drafts for the sequences of `running` that may draft, each cut to the
        length the goodput policy picks for this step (all of it while the cost fit is not ready).
        `after_step`: the last step in flight (blocks given back wait for it)."""
        spec, threshold = self.config, self._threshold
        proposals: dict[RequestId, list[int]] = {}
        alphas: dict[RequestId, float] = {}
        base_tokens = base_yield = 0
        self._alone = len(running) == 1
        self.running(running)
        limit = spec.max_batch_to_draft
        if limit is not None and len(running) > limit:
            self.stop_drafting(running, after_step)
            return {}  # vLLM's disable_by_batch_size: a big batch verifies at a loss
        for seq in running:
            total = len(seq.token_ids) + seq.num_placeholders
            gap = total - seq.num_computed_tokens
            if gap <= 0:
                continue
            base_tokens += min(gap, threshold) if threshold > 0 else gap
            base_yield += 1
            if not self._may_draft(seq, total):
                continue
            limit = min(spec.num_speculative_tokens, seq.request.max_num_tokens - total - 1)
            drafts = self.draft(seq, limit)
            if drafts:
                proposals[seq.seq_id] = drafts
                alphas[seq.seq_id] = acceptance_rate(seq.spec_accepts, seq.spec_tries)
        cost = self._cost.coefficients()
        if cost is None or not proposals:
            return proposals
        lengths = choose_draft_lengths({sid: len(d) for sid, d in proposals.items()}, alphas,
                                       base_tokens, base_yield, cost)
        return {sid: d[:lengths[sid]] for sid, d in proposals.items() if lengths[sid]}

    def running(self, running: list[Sequence]) -> None:
        """The step's running sequences, before any `draft` (for a proposer that reads the batch)."""

    def stop_drafting(self, running: list[Sequence], after_step: int | None) -> None:
        """This step drafts nothing (the batch is over `disable_by_batch_size`)."""

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        """At most `limit` (>= 0) draft tokens to follow `seq`'s last token; [] for none."""
        raise NotImplementedError

    def finished(self, seq: Sequence) -> None:
        """`seq` ended (finished, aborted, failed): drop what was kept for it."""

    def release_one(self, running: list[Sequence], step_id: int, after_step: int | None) -> bool:
        """Give blocks back before the scheduler preempts a sequence for room; False: none to give
        (only a draft model holds blocks of its own)."""
        return False

    def schedule(self, draft: StepDraft, seq: Sequence, drafts: list[int], budget: int) -> int:
        """Give `seq` (one `propose` chose) its drafts, as many as fit in the budget and the pool
        without preempting: blocks, plan entries and the draft's record; the scheduler commits it
        as a decode. Returns the tokens it takes from the budget (0: none, nothing changed)."""
        if budget < 2:  # its own token and at least one draft
            return 0
        drafts = drafts[:budget - 1]
        num_new = 1 + len(drafts)
        kv = self._kv
        if not kv.pool.can_allocate(kv.blocks_needed(seq, num_new), seq.request.tenant):
            return 0  # the plain decode path may preempt for its one token; drafts never do
        plan = draft.plan
        kv.grow(seq, num_new, plan)
        plan.num_scheduled_tokens[seq.seq_id] = num_new
        plan.draft_token_ids[seq.seq_id] = drafts
        draft.spec.append((seq, seq.generation, len(drafts)))
        return num_new

    def settle(self, spec: list[tuple[Sequence, int, int]], request_ids: list[RequestId],
               after_step: int | None) -> None:
        """Apply the acceptance of the step's drafted sequences (their tokens are appended); blocks
        only rejected drafts touched are released after `after_step` (the last one in flight)."""
        gained = Counter(request_ids)
        bs = self._kv.block_size
        for seq, generation, num_drafts in spec:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            accepted = max(gained[seq.seq_id] - 1, 0)
            seq.spec_accepts, seq.spec_tries = update_record(seq.spec_accepts, seq.spec_tries, num_drafts, accepted)
            self.num_accepted_tokens += accepted
            for pos in range(accepted):
                self.accepted_per_pos[pos] += 1
            if seq.status is not SeqStatus.RUNNING or seq.generation != generation:
                continue  # finished inside the run (or since): its blocks are already released
            seq.num_computed_tokens += accepted
            keep = seq.num_computed_tokens // bs + 1
            table = seq.block_table
            if len(table) > keep:
                self._kv.release(table[keep:], after_step)
                del table[keep:]


class NgramSpeculator(Speculator):
    """Prompt lookup over the sequence's own prompt + output (vLLM's "ngram"), each draft no longer
    than its match (`propose_ngram_matched`); and, where a batch-mate's output matches longer, over
    the other running sequences' outputs (`prompt_lookup_batch`, batch_lookup.py)."""

    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager, threshold: int) -> None:
        super().__init__(config, kv, threshold)
        self._batch = BatchLookup(config.prompt_lookup_max) if config.prompt_lookup_batch else None

    def running(self, running: list[Sequence]) -> None:
        if self._batch is not None:
            for seq in running:
                if seq.request.beam is None:  # a beam's tokens are re-pointed at will
                    self._batch.index(seq)

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        spec = self.config
        if self._alone:
            # Alone, a step is bound by reading the weights and drafts past the match are almost
            # free: a copy that goes on past it is then still caught (forced copy task at batch
            # 1: 1.73x with the cut, docs/speculative_decoding.md)
            return propose_ngram(seq.token_ids, limit, spec.prompt_lookup_min, spec.prompt_lookup_max)
        drafts, matched = match_ngram(seq.token_ids, limit, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if self._batch is not None and matched < limit:
            mates, mates_matched = self._batch.lookup(seq, limit)
            if mates_matched > matched:
                return mates
        return drafts

    def finished(self, seq: Sequence) -> None:
        if self._batch is not None:
            self._batch.drop(seq)
