"""What the scheduler core hands back to its callers: per-sequence deltas after each step, and its
stats (a snapshot of counters that only ever grow, and of gauges)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason
from pagoda.contract.step import TokenLogprobs
from scheduler_svc.core.request import KvHandoff, Sequence


@dataclass(slots=True)
class SequenceDelta:
    """New tokens of one sequence of one request since the last delta; final when finish_reason."""

    request_id: RequestId  # the caller's id (the same for all n sequences)
    seq_index: int  # 0..n-1
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # empty unless asked for
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # with FinishReason.ERROR: why this request alone failed (poison.py)
    cumulative_logprob: float | None = None  # beam search: the finished beam's summed logprobs
    # With prompt_logprobs: the logprobs of prompt tokens 1.. (the first has none), once per
    # request, on sequence 0's delta that carries its first token.
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None  # a pooling request's vector, with its one (unread) token
    migration: KvHandoff | None = None  # with FinishReason.MIGRATED: where its KV went (tiers/migration.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerCounters:
    """The scheduler's own totals (its features keep theirs); SchedulerStats reports them."""

    num_preemptions: int = 0
    prompt_tokens: int = 0  # counted at a request's first admission
    generation_tokens: int = 0  # sampled tokens accepted
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens served from it
    prefill_tokens_computed: int = 0  # recomputation after preemption included
    encoder_tokens: int = 0  # image embedding rows the worker's vision encoder produced
    encoder_cache_hits: int = 0  # image lookups its encoder cache served
    last_step_images: tuple[str, ...] = ()  # hashes of the images the last step encodes
    last_step: tuple[int, int, int] = (0, 0, 0)  # (prefill tokens, decode sequences, preemptions)

    def note_admission(self, seq: Sequence, num_hit: int) -> bool:
        """Count an admission of `seq` with `num_hit` prompt tokens served from the prefix cache;
        True at its request's first admission (which fixes the request's num_cached_tokens)."""
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += num_hit
        req = seq.request
        if req.admitted:  # a resumed request's recomputation is not a cache hit (vLLM #25780)
            return False
        req.admitted = True
        req.num_cached_tokens = num_hit
        self.prompt_tokens += req.num_prompt_tokens
        return True


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's figures (tenants.py)."""

    tenant: str
    blocks_held: int  # in use + cached, owned (block_pool.py)
    blocks_cap: int
    prompt_tokens: int  # total, counted at a request's first admission
    generation_tokens: int  # total sampled tokens accepted
    num_waiting: int  # sequences
    virtual_tokens: float  # the fair-share counter


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int  # sequences
    num_waiting: int  # sequences
    num_free_blocks: int
    num_evictable_blocks: int  # cached prefix blocks with ref 0
    num_used_blocks: int
    kv_usage: float  # used / total, 0..1
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens served from it
    num_preemptions: int  # total
    prompt_tokens: int  # total, counted at a request's first admission
    generation_tokens: int  # total sampled tokens accepted
    last_step_prefill_tokens: int
    last_step_decode_tokens: int
    last_step_preemptions: int
    num_resident_tokens: int  # tokens whose KV the running sequences hold (fragmentation studies)
    blocks_allocated: int = 0  # total blocks taken from the pool (free list or evictable LRU)
    blocks_freed: int = 0  # total blocks returned to it
    num_step_failures: int = 0  # failed steps (the worker's forward or sampler raised)
    num_requests_isolated: int = 0  # requests failed alone for them (poison.py)
    spec_num_drafts: int = 0  # sequence-steps that carried draft tokens (spec/)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # [i]: drafts accepted at position i (0-based)
    num_pinned_blocks: int = 0  # prefix blocks held for pinned prompts (pinning.py)
    brownout_active: bool = False  # under memory pressure: smaller steps, capped max_tokens (brownout.py)
    brownout_entries: int = 0  # times brownout was entered
    brownout_capped_requests: int = 0  # requests whose max_tokens brownout lowered
    # Multi-LoRA (vLLM's lora_requests_info): adapter names with running / waiting requests
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0  # 0: LoRA off
    # Swap preemption (swap.py)
    num_swapped: int = 0  # waiting sequences (counted in num_waiting) whose KV is in host blocks
    num_swap_preemptions: int = 0  # preemptions that swapped (of num_preemptions)
    blocks_swapped_out: int = 0  # total
    blocks_swapped_in: int = 0  # total
    num_cpu_blocks: int = 0  # the host pool; 0: none
    cpu_kv_usage: float = 0.0  # used / total host blocks, 0..1
    # Tokens computed in prefill chunks, recomputation after preemption included (what swapping saves)
    prefill_tokens_computed: int = 0
    encoder_tokens: int = 0  # vision-language models: image embedding rows encoded (docs/vision.md)
    encoder_cache_hits: int = 0  # image lookups the worker's encoder cache served
    last_step_images: tuple[str, ...] = ()  # hashes of the images the last step encodes (its span)
    # The prefix cache's host tier (tiers/host_tier.py)
    num_offload_blocks: int = 0  # its capacity; 0: none
    offload_kv_usage: float = 0.0  # offloaded / capacity, 0..1
    blocks_offloaded: int = 0  # total device -> host copies of evicted cached blocks
    blocks_loaded: int = 0  # total host -> device copies (prefix hits served from the host)
    blocks_offload_dropped: int = 0  # total entries the full tier dropped
    # The prefix cache's disk tier (tiers/disk_tier.py)
    num_disk_blocks: int = 0  # its capacity in files; 0: none
    disk_kv_usage: float = 0.0  # files / capacity, 0..1
    blocks_disk_written: int = 0  # total host -> file writes of blocks the host tier dropped
    blocks_disk_loaded: int = 0  # total file -> device loads (prefix hits served from disk)
    blocks_disk_dropped: int = 0  # total files the full tier deleted, or blocks it had no room for
    num_sessions: int = 0  # live session leases (tiers/sessions.py)
    num_session_blocks: int = 0  # device blocks they pin
    tenants: tuple[TenantStats, ...] = ()  # per tenant seen (tenants.py)
