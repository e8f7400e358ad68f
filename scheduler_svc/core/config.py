"""The scheduler core's one frozen config (built from flags in `__main__`, or by the offline LLM),
and the checks it implies: the preemption mode, and a request's size against its limits.

add_request refuses, before anything is queued, what could never run (an empty prompt, a context
longer than max_model_len, more sequences than max_num_seqs, more KV blocks than the whole cache
for one request) and what the bounded queue has no room for (QueueFullError: retry later).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pagoda.contract.errors import InvalidRequestError, QueueFullError
from pagoda.contract.multimodal import check_mm_inputs
from pagoda.contract.params import check_context_length
from pagoda.runtime.math_utils import cdiv
from scheduler_svc.core.brownout import BrownoutConfig
from scheduler_svc.core.request import EngineRequest


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config '{"method": ..., ...}'`: "ngram" (prompt lookup, spec/ngram.py),
    "suffix" (suffix decoding over the request and a cache of recent outputs, spec/suffix.py) or
    "draft_model" (a draft model on the worker, spec/draft_model.py: implied by a "model" key)."""

    num_speculative_tokens: int = 4  # K: drafts proposed per step at most
    prompt_lookup_max: int = 4  # ngram: the longest suffix n-gram looked up first
    prompt_lookup_min: int = 2  # ngram: the shortest one tried before giving up
    method: Literal["ngram", "suffix", "draft_model"] = "ngram"
    # draft_model: the worker loads it (a directory, a GGUF, or "self:q4": the target quantized to
    # int4 at load); the scheduler only needs to know that one drafts, and owns its KV blocks.
    model: str | None = None
    # vLLM's key: no drafts in a step that runs more than this many sequences (None: the default,
    # 8 for a draft model, never for ngram/suffix). Why: at batch 8 on CPU a step already computes
    # 8 rows, and the k draft-model forwards plus k verification rows a sequence cost about what
    # they save; the goodput policy (spec_policy.py) does not price the draft model's forwards.
    disable_by_batch_size: int | None = None
    # ngram (Pagoda's, not vLLM's): also look the last prompt_lookup_max tokens up in the other
    # running sequences' outputs, taken where that match is the longer (spec/batch_lookup.py)
    prompt_lookup_batch: bool = True
    # suffix (vLLM's names and defaults, but the token budget): the deepest a suffix-tree path goes
    # (longest pattern matched + draft), the finished requests whose outputs stay cached (and how
    # many of their tokens, at most: the cache costs up to depth nodes a token), draft length
    # <= factor * matched length, and the lowest path probability a draft token may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 65536
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "suffix", "draft_model"):
            raise ValueError(f"speculative method {self.method!r} is not supported: only 'ngram', "
                             "'suffix' and 'draft_model' (a \"model\" key)")
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError("a draft model needs method 'draft_model' (or none) and a \"model\"; "
                             f"method {self.method!r} takes no model")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not 2 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ValueError("suffix_decoding_max_tree_depth must be in [2, 256]")
        if self.suffix_decoding_max_cached_requests < 0 or self.suffix_decoding_max_cached_tokens < 0:
            raise ValueError("suffix_decoding_max_cached_requests/_tokens must be >= 0 (0: no cache)")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """From the flag's JSON (or LLM's dict); None or empty: no speculation. ValueError if bad."""
        if not value:
            return None
        fields = json.loads(value) if isinstance(value, str) else dict(value)
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        if fields.get("model") and "method" not in fields:  # vLLM infers the method from the model
            fields["method"] = "draft_model"
        return cls(**fields)

    @property
    def max_batch_to_draft(self) -> int | None:
        """Steps running more sequences than this draft nothing (None: no limit)."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return DRAFT_MODEL_MAX_BATCH if self.method == "draft_model" else None


DRAFT_MODEL_MAX_BATCH = 8  # docs/speculative_decoding.md, "Draft model": when drafting stops


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int  # from the worker's Init answer
    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # A prefill longer than this gets at most this many tokens per step, so one long prompt cannot
    # monopolise a step. 0 = auto (max_num_batched_tokens // 2).
    long_prefill_token_threshold: int = 0
    # Image embedding rows the worker may encode per step (vLLM's --max-num-encoder-input-tokens;
    # step_draft.cut_for_encoder). 0 = max_num_batched_tokens.
    max_num_encoder_input_tokens: int = 0
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 4096  # the bounded queue: beyond it add_request raises QueueFullError
    max_waiting_tokens: int | None = None  # optional bound on the prompt tokens waiting
    eos_token_ids: tuple[int, ...] = ()
    policy: Literal["fcfs", "priority"] = "fcfs"
    # Which waiting sequence admission tries next (tiers/prefill_order.py): the queue's head, or
    # "cached-first", the earliest with fewer tokens left to compute after its prefix hit than the
    # head (multi-turn sessions; the head is passed at most 16 times). "auto": cached-first with a
    # host KV tier (num_offload_blocks > 0), where a returning session's history is a hit whatever
    # the device pool evicted, so its turn is cheap to serve first; FCFS otherwise.
    admission_order: Literal["auto", "fcfs", "cached-first"] = "auto"
    max_inflight_steps: int = 2  # 2 = the next plan goes out before the last result is back
    # The worker's pipeline stages (worker_svc/parallel/pipeline.py). Above 1: up to that many plans in
    # flight (one per stage: vLLM's virtual engines), each with about 1/N of the running sequences,
    # and a sequence whose sampled token is in flight waits for it (stage 0 embeds that token).
    pipeline_parallel_size: int = 1
    # A request that took part in this many failed steps is failed (poison.py); one that fails a
    # step alone, after failing one batched, is failed at once.
    max_step_failures: int = 3
    # speculative decoding (core/spec/); None: off. With it on, one step is in flight
    # at a time: proposing needs every sequence's last token, and a step after one whose
    # acceptance is unknown would not know where its tokens go.
    speculative: SpeculativeConfig | None = None
    # Brownout under sustained memory pressure (core/brownout.py); None: off.
    brownout: BrownoutConfig | None = None
    # Distinct LoRA adapters running at once (the worker's --max-loras, from its Init); 0: LoRA off.
    max_loras: int = 0
    # Swap preemption (core/swap.py): host blocks of the worker's swap space (from its Init; 0: none),
    # and vLLM's --preemption-mode: "recompute", "swap", or None (auto: swap a sequence whose computed
    # tokens exceed one prefill chunk, long_prefill_token_threshold, when the host pool has room).
    num_cpu_blocks: int = 0
    preemption_mode: Literal["recompute", "swap"] | None = None
    # The prefix cache's host tier (core/tiers/host_tier.py): host blocks of the worker's
    # --kv-offloading-size (from its Init; host ids after the swap space's). 0: evicted prefixes drop.
    num_offload_blocks: int = 0
    # The prefix cache's disk tier (core/tiers/disk_tier.py), under the host tier: files the
    # worker's --kv-offload-dir-size holds (from its Init). 0: the host tier's drops are dropped.
    num_disk_blocks: int = 0
    # The model's sliding window when every layer has one (the worker's Init); 0: none. Blocks
    # wholly before a sequence's window are freed (kv_cache_manager.py: free_out_of_window).
    sliding_window: int = 0
    # Tenants (core/tenants.py): the fraction of the device pool each tenant may hold (in use +
    # cached + leased; a request's kv_share overrides it for its tenant), 1.0 = no cap; and
    # fair-share admission by virtual token counter ("vtc": a tenant's counter grows by
    # prompt tokens * vtc_prompt_weight + output tokens * vtc_output_weight) or none ("off").
    tenant_kv_share: float = 1.0
    tenant_fairness: Literal["off", "vtc"] = "off"
    vtc_prompt_weight: float = 1.0
    vtc_output_weight: float = 2.0
    # The worker exports and imports migrated requests' KV (its Init; core/tiers/migration.py).
    kv_migration: bool = False
    # --kv-transfer grpc (worker_svc/kv_transfer/): where other workers fetch this worker's exports
    # (handoffs carry it); "": exports and imports go through the shared folder.
    kv_transfer_address: str = ""
    kv_snapshots: bool = False  # the worker saves and restores session snapshots (--kv-snapshot-dir)

    def __post_init__(self) -> None:
        check_preemption_mode(self.preemption_mode, has_host_pool=self.num_cpu_blocks >= 1)
        if not 0.0 < self.tenant_kv_share <= 1.0:
            raise ValueError(f"tenant_kv_share must be in (0, 1], got {self.tenant_kv_share}")
        if self.tenant_fairness not in ("off", "vtc"):
            raise ValueError(f"tenant_fairness must be 'off' or 'vtc', got {self.tenant_fairness!r}")

    @property
    def encoder_budget(self) -> int:
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def cached_first(self) -> bool:
        """Whether admission runs the cached-first order (`admission_order`, "auto" resolved)."""
        if self.admission_order == "auto":
            return self.num_offload_blocks > 0
        return self.admission_order == "cached-first"


def check_preemption_mode(mode: str | None, has_host_pool: bool) -> None:
    """ValueError for an unknown mode, or "swap" without swap space; the offline LLM calls it
    before loading the model too (there, swap_space > 0 stands for the pool)."""
    if mode not in (None, "recompute", "swap"):
        raise ValueError(f"preemption_mode must be 'recompute' or 'swap' (or None: auto), got {mode!r}")
    if mode == "swap" and not has_host_pool:
        raise ValueError("preemption_mode 'swap' needs a host block pool: give the worker swap "
                         "space (--swap-space GiB, LLM(swap_space=...)) large enough for a block")


def check_request(cfg: SchedulerConfig, request: EngineRequest, num_waiting: int, waiting_tokens: int,
                  tenant_cap: int | None = None) -> int:
    """Raise InvalidRequestError or QueueFullError (`num_waiting` requests with `waiting_tokens`
    prompt tokens wait; its tenant may hold `tenant_cap` blocks); else its effective max_tokens."""
    prompt, sampling = request.prompt_token_ids, request.sampling
    if not 0.0 <= request.kv_share <= 1.0:  # (NaN fails too)
        raise InvalidRequestError(f"kv_share must be in [0, 1] (0: the scheduler's default), got {request.kv_share}")
    if not prompt:
        raise InvalidRequestError("the prompt is empty: at least one token is required")
    check_context_length(cfg.max_model_len, len(prompt), sampling.max_tokens)
    try:
        check_mm_inputs(request.mm_inputs, len(prompt))
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None
    if request.num_prior_output_tokens:
        if request.num_prior_output_tokens >= len(prompt):
            raise InvalidRequestError("num_prior_output_tokens must be less than the prompt's length")
        if sampling.n > 1 or sampling.beam_width or sampling.prompt_logprobs is not None:
            # One sequence's earlier output: n > 1 and beams have several; prompt logprobs would
            # cover the earlier output as if it were prompt.
            raise InvalidRequestError("num_prior_output_tokens needs n=1, no beam search and no "
                                      "prompt_logprobs")
    max_tokens = cfg.max_model_len - len(prompt) if sampling.max_tokens is None else sampling.max_tokens
    num_seqs = sampling.beam_width or sampling.n
    if num_seqs > cfg.max_num_seqs:
        what = f"beam width {num_seqs}" if sampling.beam_width else f"n={num_seqs}"
        raise InvalidRequestError(f"{what} exceeds max_num_seqs={cfg.max_num_seqs}")
    blocks = cdiv(len(prompt) + max_tokens - 1, cfg.block_size)
    if sampling.beam_width:  # a group runs whole: every beam at full length, at worst unshared
        blocks *= sampling.beam_width
    if blocks > cfg.num_blocks:
        raise InvalidRequestError(f"the request needs {blocks} KV blocks but the cache has only "
                                  f"{cfg.num_blocks}")
    if tenant_cap is not None and blocks > tenant_cap:
        raise InvalidRequestError(f"the request needs {blocks} KV blocks but tenant "
                                  f"{request.tenant!r} may hold only {tenant_cap} (its KV share)")
    if request.lora is not None and not cfg.max_loras:
        raise InvalidRequestError(f"LoRA adapter {request.lora.lora_name!r} requested, but LoRA is "
                                  "not enabled (start the worker with --enable-lora)")
    if num_waiting >= cfg.max_waiting_requests:
        raise QueueFullError(f"the waiting queue is full: {num_waiting} of "
                             f"{cfg.max_waiting_requests} requests waiting; retry later")
    if cfg.max_waiting_tokens is not None and waiting_tokens + len(prompt) > cfg.max_waiting_tokens:
        raise QueueFullError(f"the waiting queue is full: {waiting_tokens} of "
                             f"{cfg.max_waiting_tokens} prompt tokens waiting; retry later")
    return max_tokens
