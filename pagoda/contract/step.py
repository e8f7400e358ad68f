"""The step plan, the step result and Init's answer: the contract between scheduler and worker.

A plan carries *changes* only (DESIGN.md, "The scheduler↔worker protocol"):
- a request's prompt, params and block ids travel once, in `new_requests` (also when a preempted
  request resumes: then `token_ids` holds prompt + output so far and it is recomputed);
- every resident request is scheduled for exactly 1 token unless `num_scheduled_tokens` says
  otherwise (0 = resident but skipped this step; >1 = a prefill chunk);
- block tables change only through `table_updates` (append, or replace one entry for copy-on-write);
- swap preemption moves KV between the device cache and the worker's host pool (`swap_out`,
  `swap_in`): a swapped-out request is preempted (dropped), and resumes as a new request whose
  num_computed_tokens counts the tokens whose KV the swap-in brings back;
- the prefix cache's disk tier moves KV between the host pool (or an evicted device block) and
  block files keyed by hash (`disk_writes`, `disk_deletes`) and from files into device blocks
  (`disk_loads`); `WorkerInfo.disk_blocks` lists the files at every Init;
- the worker keeps its own sampled tokens; they are never echoed back.

The worker derives the rest itself: a request samples in a step when, after the step,
num_computed_tokens == len(token_ids). These are pure data: `worker_codec.py` maps them to protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.lora import LoRARequest
from pagoda.contract.multimodal import MultiModalInput
from pagoda.contract.params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request that becomes resident on the worker (new, or resumed after preemption)."""

    request_id: RequestId
    token_ids: list[int]  # prompt, plus the outputs so far when resuming
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt (penalties need the split)
    block_ids: list[BlockId]  # the whole table known so far
    num_computed_tokens: int  # tokens already in the cache (prefix hit); computing starts here
    num_scheduled_tokens: int  # tokens to compute in this step (>=1)
    sampling: SamplingParams
    seq_index: int = 0  # which of the n sequences this is (seeds sampling of forks)
    lora: LoRARequest | None = None  # the adapter it runs under (the worker loads it); None: base
    mm_inputs: tuple[MultiModalInput, ...] = ()  # the prompt's images (the worker encodes them)


@dataclass(slots=True)
class TableUpdate:
    """Set block_table[start:start+len(block_ids)] = block_ids (an append when start == len)."""

    request_id: RequestId
    start: int
    block_ids: list[BlockId]


@dataclass(slots=True)
class BlockCopy:
    """Copy every layer's K and V of block `src` into block `dst` before the step: copy-on-write
    (both device blocks), or a swap (one device block, one host block: see StepPlan)."""

    src: BlockId
    dst: BlockId


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """A prefix block in the disk tier (`--kv-offload-dir`), keyed by its chained block hash, with
    the token ids and extra keys the scheduler verifies a hit against (as its prefix index does)."""

    block_hash: bytes
    token_ids: tuple[int, ...]
    extra_keys: tuple = ()


@dataclass(slots=True)
class DiskWrite:
    """Write host block `src` (the host tier's slot, about to be reused) to the file of `block`; or,
    `from_device`, device block `src` (evicted while every host slot was busy in the plan)."""

    src: int
    block: DiskBlock
    from_device: bool = False


@dataclass(slots=True)
class DiskLoad:
    """Read the file of `block_hash` into device block `dst` (a prefix hit served from disk)."""

    block_hash: bytes
    dst: BlockId


@dataclass(slots=True)
class KvExport:
    """Live migration, on the source: write blocks [0, len(block_ids)) of `request_id`'s table
    (its first `num_tokens` tokens' KV) to the shared migration directory under `migration_id`."""

    request_id: RequestId
    migration_id: str
    block_ids: list[BlockId]
    num_tokens: int
    # A session save: `migration_id` names the snapshot in --kv-snapshot-dir, `request_id` is ""
    # (the blocks are a session lease's, not a resident request's) and `token_ids` are their tokens.
    snapshot: bool = False
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class KvImport:
    """Live migration, on the target: migrated files first_block, first_block + 1, ... into device
    blocks `block_ids` of the new request `request_id` (verified against its first `num_tokens`
    token ids, the exported ones)."""

    request_id: RequestId
    migration_id: str
    first_block: int
    block_ids: list[BlockId]
    num_tokens: int
    snapshot: bool = False  # a session restore: read from --kv-snapshot-dir (the files stay)


@dataclass(slots=True)
class Fork:
    """Parallel sampling (n>1): after this step's forward, `parent` sampled its first token.

    Each child takes a copy of the parent's state (tokens, num_computed, block table — shared
    blocks, ref-counted by the scheduler) and samples its own first token from the parent's
    final-prompt logits with its own randomness (seq_index = position in the list + 1).
    """

    parent_id: RequestId
    child_ids: list[RequestId]


@dataclass(slots=True)
class BeamUpdate:
    """Beam search: after the step that reported its beams' candidates, `request_id` becomes a copy
    of `parent_id`'s state as that step left it (tokens, num_computed, table — shared blocks,
    ref-counted by the scheduler) with its last, not yet computed token replaced by `token_id`.

    All of a plan's updates read the states from before any of them applies (a parent may be
    overwritten by another update); an id not resident yet becomes resident (the beams' first
    fork). Applied before `table_updates`, which then refer to the new tables.
    """

    request_id: RequestId
    parent_id: RequestId
    token_id: int


@dataclass(slots=True)
class ModelDraft:
    """Draft-model speculation (scheduler_svc/core/spec/draft_model.py): the worker's draft model
    proposes `num_drafts` tokens after the request's last token; the target verifies them in the
    same step (the request's scheduled count is 1 + num_drafts). The draft's KV lives in the same
    block pool as the target's, in a second table per request that the scheduler owns: the worker's
    copy becomes table[:table_start] + block_ids (the scheduler sends the tail that changed, so a
    rollback needs no rule on the worker). The draft's cache holds positions [0, num_computed)."""

    request_id: RequestId
    num_drafts: int
    num_computed: int
    table_start: int
    block_ids: list[BlockId]


@dataclass(slots=True)
class StepPlan:
    step_id: int  # +1 per plan on a stream; a gap is an error
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_ids: list[RequestId] = field(default_factory=list)  # finished or aborted: drop state
    preempted_ids: list[RequestId] = field(default_factory=list)  # drop state; resumes as new
    table_updates: list[TableUpdate] = field(default_factory=list)
    num_scheduled_tokens: dict[RequestId, int] = field(default_factory=dict)  # resident, != 1
    block_copies: list[BlockCopy] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    traceparent: str = ""  # W3C trace context of the scheduler's step span
    # Speculative decoding: draft tokens to verify after a resident request's last token. Its count
    # is 1 + len(drafts); the worker computes them all, keeps the longest accepted prefix plus one
    # token of its own, and rolls back the rest (its num_computed and its table: see StepResult).
    draft_token_ids: dict[RequestId, list[int]] = field(default_factory=dict)
    beam_updates: list[BeamUpdate] = field(default_factory=list)
    # Swap preemption (scheduler_svc/core/swap.py), run before this step's block copies and forward,
    # in this order: swap_out (device block src -> host block dst) then swap_in (host block src ->
    # device block dst). Device blocks freed by a swap-out may thus be reused in the same step.
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    # The prefix cache's disk tier (scheduler_svc/core/tiers/disk_tier.py), run around the swaps in
    # this order: disk_deletes (files the full tier drops), disk_writes (host slots the host tier
    # drops, read before a swap_out refills them), swap_out, swap_in, then disk_loads (file ->
    # device block, after the swap_out that may have saved the block's old content).
    disk_deletes: list[bytes] = field(default_factory=list)
    disk_writes: list[DiskWrite] = field(default_factory=list)
    disk_loads: list[DiskLoad] = field(default_factory=list)
    # Live migration (scheduler_svc/core/tiers/migration.py): exports run first of all (before the
    # finished ids drop their requests, before anything writes a block); imports with disk_loads.
    kv_exports: list[KvExport] = field(default_factory=list)
    kv_imports: list[KvImport] = field(default_factory=list)
    model_drafts: list[ModelDraft] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.finished_ids or self.preempted_ids
                    or self.table_updates or self.num_scheduled_tokens or self.block_copies
                    or self.forks or self.draft_token_ids or self.beam_updates or self.swap_out
                    or self.swap_in or self.disk_deletes or self.disk_writes or self.disk_loads
                    or self.kv_exports or self.kv_imports or self.model_drafts)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token, and the top-k alternatives (token id, logprob), best first."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + tokens more likely than this one (set for prompt tokens)


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens computed by one step: the tokens at indices
    start .. start+len(logprobs)-1 of the prompt (start >= 1: the first token has none)."""

    request_id: RequestId
    start: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class Embedding:
    """A pooling request's pooled final hidden state, reported with its last prefill chunk."""

    request_id: RequestId
    values: list[float]


@dataclass(slots=True)
class StepResult:
    """One sampled token per request that sampled in this step (forks included), in entries of
    request_ids / token_ids. A beam-search request's entry carries its candidates in `logprobs`
    (`top`: the num_beam_candidates best tokens by raw logprob); the scheduler picks the beams. A request with drafts has one entry per token it gained, back to back:
    the accepted drafts, then its own sampled token. Both sides then cut the request's block table
    to the blocks covering positions <= its num_computed_tokens (the rejected drafts' blocks)."""

    step_id: int
    request_ids: list[RequestId] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # empty when none asked
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    # Requests with prompt_logprobs: what this step's prefill chunk covered (worker_svc/prompt_logprobs.py)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    embeddings: list[Embedding] = field(default_factory=list)  # pooling requests (SamplingParams.pooling)
    num_encoder_tokens: int = 0  # image embedding rows the vision encoder produced this step
    num_encoder_cache_hits: int = 0  # image lookups its encoder cache served instead


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What Init answers: the scheduler sizes its block pool from this."""

    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    model_name: str
    max_loras: int = 0  # distinct LoRA adapters a step may use; 0: LoRA disabled
    max_lora_rank: int = 0
    num_cpu_blocks: int = 0  # host blocks for swapped-out KV (--swap-space); 0: preemption recomputes
    # Host blocks of the prefix cache's host tier (--kv-offloading-size): host ids after the swap
    # space's, [num_cpu_blocks, num_cpu_blocks + num_offload_blocks); 0: evicted prefixes are dropped.
    num_offload_blocks: int = 0
    # Every layer attends within a sliding window, none wider than this (Mistral v0.1): KV blocks
    # wholly before it are never read again, and the scheduler frees them. 0: some layer (or every
    # one) attends to all positions.
    sliding_window: int = 0
    # The prefix cache's disk tier (--kv-offload-dir): files it may hold under its size cap, and
    # those it holds now (verified at Init: checksum and model fingerprint), least recently used
    # first. The scheduler rebuilds its disk index from this at every Init (a restart included).
    num_disk_blocks: int = 0
    disk_blocks: tuple[DiskBlock, ...] = ()
    kv_migration: bool = False  # it exports and imports migrated KV (--kv-migrate-dir)
    kv_snapshot_dir: str = ""  # session snapshots' folder (--kv-snapshot-dir); "": no save / restore
    # Pipeline stages (worker_svc/parallel/pipeline.py): the scheduler keeps up to this many plans in
    # flight, never one sequence in two of them while its sampled token is unknown.
    pipeline_parallel_size: int = 1
    kv_transfer_address: str = ""  # --kv-transfer grpc: where its exports are fetched; "": the folder
