"""What the engine accepts (EngineRequest) and the state it keeps per request: a Request owns 1..n
Sequences; the Sequence is the unit of scheduling. A beam-search request also owns its BeamGroup.

Sequence 0 of a request uses the request id itself; forked child i uses f"{request_id}#{i}".
This module is a leaf of the core's import graph (it imports only pagoda.contract and the pure
ranking in beam_search.py): every other core module may import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.lora import LoRARequest
from pagoda.contract.multimodal import MultiModalInput, mm_block_keys
from pagoda.contract.params import FinishReason, SamplingParams, num_beam_candidates
from pagoda.contract.prefix_hash import block_extra_keys
from pagoda.contract.step import StepPlan, TokenLogprobs
from scheduler_svc.core.beam_search import BeamSearch, Candidate


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def child_seq_id(request_id: RequestId, seq_index: int) -> RequestId:
    return request_id if seq_index == 0 else RequestId(f"{request_id}#{seq_index}")


@dataclass(frozen=True, slots=True)
class KvHandoff:
    """A migrated request's KV (tiers/migration.py): `num_blocks` block files under `migration_id` in
    the workers' shared migration folder, holding its first `num_tokens` tokens' KV, or (`source`
    set, --kv-transfer grpc) those blocks in the source worker's memory, fetched from that address.
    An export's answer on the source; a continuation's import on the target. num_blocks 0: nothing
    exported."""

    migration_id: str
    num_tokens: int
    num_blocks: int
    snapshot: bool = False  # a session restore: `migration_id` names a session snapshot (tiers/snapshots.py)
    source: str = ""  # host:port of the source worker's KvTransfer service; "": the shared folder


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request as the engine accepts it: token ids in, one or more sequences out."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first (vLLM's convention); ties break by arrival
    cache_salt: str | None = None  # keeps one tenant's prefix cache invisible to another
    lora: LoRARequest | None = None  # the adapter to run under; None: the base model
    # A mid-stream failover's continuation (the gateway's): the last this-many prompt tokens are
    # output this request already produced elsewhere. The scheduler's own limits (max_tokens,
    # min_tokens) count new tokens only; the worker is told they are output (Request.worker_*).
    num_prior_output_tokens: int = 0
    # A session lease (tiers/sessions.py): when this request finishes its history's blocks stay pinned
    # for session_ttl seconds, for the session's next turn. None: no lease.
    session_id: str | None = None
    session_ttl: float = 0.0
    # The tenant (the gateway's API-key tenant; "" anonymous): its KV blocks are counted against
    # its cap, and fair-share admission ranks it (tenants.py). kv_share: its cap as a fraction of
    # the pool (the keys file's); 0: the scheduler's --tenant-kv-share.
    tenant: str = ""
    kv_share: float = 0.0
    # A migrated request's continuation (with num_prior_output_tokens): KV to load, not compute.
    kv_import: KvHandoff | None = None
    # The prompt's images (docs/vision.md): their placeholder runs and pixels, by offset.
    mm_inputs: tuple[MultiModalInput, ...] = ()


@dataclass(slots=True, eq=False)
class Request:
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int  # effective: sampling.max_tokens, or what max_model_len leaves
    priority: int
    arrival_time: float
    arrival_order: int  # ties of (priority, arrival_time) break by this
    cache_salt: str | None
    lora: LoRARequest | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_unfinished: int = 0  # of the n sequences, counting those not forked yet
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: bool = False
    num_step_failures: int = 0  # failed steps it took part in (poison.py)
    # Tokens that may end this request (its stop ids, plus EOS unless ignore_eos): the scheduler
    # sets it in add_request, so a step calls stop_reason() only for such a token or at the limit.
    stop_token_set: frozenset[int] = frozenset()
    beam: BeamGroup | None = None  # beam search (beam_group.py); None: n independent sequences
    num_prior_output_tokens: int = 0  # EngineRequest's
    session_id: str | None = None  # EngineRequest's (tiers/sessions.py)
    session_ttl: float = 0.0
    tenant: str = ""  # EngineRequest's (tenants.py)
    kv_import: KvHandoff | None = None  # EngineRequest's, until its first admission loads it
    mm_inputs: tuple[MultiModalInput, ...] = ()  # EngineRequest's: sent with every NewRequestData
    # Fields, not properties: read for every sequence on every step.
    num_prompt_tokens: int = field(init=False)
    max_num_tokens: int = field(init=False)  # prompt + max_tokens: no token is sampled beyond it

    lora_key: str | None = field(init=False)  # part of its prefix-cache keys
    # With sampling.prompt_logprobs: those of prompt tokens 1.. received so far (the worker reports
    # them chunk by chunk); handed out whole with sequence 0's first token. None: not asked.
    prompt_logprobs: list[TokenLogprobs] | None = field(init=False)
    # What the worker is told (a continuation's earlier output counted as output there, so seeded
    # draws, penalties, bad words, grammar and min_tokens masking go on where they stopped).
    worker_num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        prior = self.num_prior_output_tokens
        self.worker_num_prompt_tokens = self.num_prompt_tokens - prior
        self.max_num_tokens = self.num_prompt_tokens + self.max_tokens
        self.lora_key = self.lora.cache_key if self.lora is not None else None
        self.prompt_logprobs = [] if self.sampling.prompt_logprobs is not None else None

    def block_keys(self, block_index: int, block_size: int) -> tuple:
        """The extra hash keys of block `block_index`: salt and adapter (first block), images overlapping it."""
        return block_extra_keys(block_index, self.cache_salt, self.lora_key,
                                mm_block_keys(self.mm_inputs, block_index, block_size))

    @property
    def worker_sampling(self) -> SamplingParams:
        # Derived at admission, not at arrival: brownout may cap `sampling` in between.
        s, prior = self.sampling, self.num_prior_output_tokens
        if not prior:
            return s
        return dataclasses.replace(s, min_tokens=s.min_tokens + prior,
                                   max_tokens=None if s.max_tokens is None else s.max_tokens + prior)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all received: its prompt must be computed from token 0
        (a prefix-cache hit would skip the logits of the cached positions)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def n(self) -> int:
        """Outputs returned."""
        return self.sampling.n

    @property
    def num_seqs(self) -> int:
        """Sequences it runs at most: its beams, else its n samples."""
        return self.sampling.beam_width or self.sampling.n


# A block-table entry whose block was freed because it fell out of every layer's sliding window
# (kv_cache_manager.py: free_out_of_window). Only the scheduler's table holds it: the worker keeps
# the old id, which attention never reads again (vLLM's null block plays the same part).
NULL_BLOCK = BlockId(-1)


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: RequestId
    seq_index: int
    request: Request
    token_ids: list[int]  # known tokens: prompt + outputs (not the placeholders)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # includes tokens of in-flight steps (advanced at schedule time)
    num_placeholders: int = 0  # tokens sampled by in-flight steps, not known yet
    block_table: list[BlockId] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks of token_ids, lazily
    num_registered_blocks: int = 0  # table[:this] is in (or verified against) the prefix index
    last_serial: int = 0  # prefix-index serial of block num_registered_blocks-1 (0 = root)
    num_window_freed: int = 0  # table[:this] is NULL_BLOCK: freed, out of the sliding window
    generation: int = 0  # +1 on preemption: facts recorded for an older generation are stale
    resident: bool = False  # the worker holds this sequence's state
    pending_fork: bool = False  # n>1 and the children are not forked yet (seq 0 only)
    # draft positions accepted / tried, older outcomes weighing less: its acceptance rate (spec_policy.py)
    spec_accepts: float = 0.0
    spec_tries: float = 0.0
    # Draft-model speculation (spec/draft_model.py): the draft model's own block table, in the same
    # pool, holding the draft's KV of positions [0, draft_num_computed); the worker knows
    # draft_table[:draft_synced] (plans send it the rest). Never shared, never prefix-cached.
    draft_table: list[BlockId] = field(default_factory=list)
    draft_num_computed: int = 0
    draft_synced: int = 0
    draft_step: int = 0  # the last plan that drafted for it (its draft blocks are written there)
    # Swapped out (swap.py): the host blocks holding the KV of its first num_swapped_tokens tokens.
    host_blocks: list[BlockId] = field(default_factory=list)
    num_swapped_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def num_slots(self) -> int:
        """Running slots this sequence takes against max_num_seqs (children included, once forked)."""
        return self.request.num_seqs if self.pending_fork else 1

    def fork(self, index: int) -> Sequence:
        """Child `index` of this sequence 0 (n>1): its tokens, computed state and blocks (copies of
        the lists: the caller shares the blocks by ref count), resident, one token in flight."""
        return Sequence(child_seq_id(self.request.request_id, index), index, self.request,
                        list(self.token_ids), num_computed_tokens=self.num_computed_tokens,
                        num_placeholders=1, block_table=list(self.block_table),
                        block_hashes=list(self.block_hashes),
                        num_registered_blocks=self.num_registered_blocks, last_serial=self.last_serial,
                        num_window_freed=self.num_window_freed, generation=self.generation, resident=True)

    def forget_draft(self) -> list[BlockId]:
        """Drop the draft model's table (preemption, finish, worker loss); its blocks, to release."""
        blocks, self.draft_table = self.draft_table, []
        self.draft_num_computed = self.draft_synced = 0
        return blocks

    def may_sample(self) -> bool:
        """Whether one more sampled token (beyond those in flight) stays within max_tokens."""
        return len(self.token_ids) + self.num_placeholders < self.request.max_num_tokens

    def stop_reason(self, token: int, eos_token_ids: tuple[int, ...]) -> FinishReason | None:
        """Checked after `token` was appended."""
        sampling = self.request.sampling
        num_out = self.num_output_tokens
        if num_out >= sampling.min_tokens:
            if (not sampling.ignore_eos and token in eos_token_ids) or token in sampling.stop_token_ids:
                return FinishReason.STOP
        if num_out >= self.request.max_tokens:
            return FinishReason.LENGTH
        return None


@dataclass(slots=True, eq=False)
class BeamGroup:
    """A beam-search request's live beams, scheduled, preempted and admitted as one (beam_group.py)."""

    search: BeamSearch
    beams: list[Sequence]  # the live beams; beams[j].seq_index == j
    cum_logprobs: list[float] = field(default_factory=lambda: [0.0])
    candidates: dict[int, list[Candidate]] = field(default_factory=dict)  # beam index -> reported
    scheduled_in: StepPlan | None = None  # the last plan drafted that considered the group (a
    # drafted plan may be dropped, when it schedules nothing, and its step id drafted again)


def new_beam_group(seq: Sequence, stop_token_ids: frozenset[int]) -> BeamGroup:
    """The group of a new beam-search request, whose only beam is its prompt's sequence."""
    sampling = seq.request.sampling
    width = sampling.beam_width
    search = BeamSearch(width, sampling.length_penalty, stop_token_ids,
                        num_beam_candidates(width, len(stop_token_ids)))
    return BeamGroup(search, [seq])
