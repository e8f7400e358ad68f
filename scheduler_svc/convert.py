"""The Engine API codec: protobuf <-> the scheduler core's dataclasses, both directions.

The only module of the scheduler service that imports both `pagoda.v1` and `scheduler_svc.core`
(plans and results use pagoda.contract.worker_codec, the one definition of the Steps wire format).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from pagoda.contract.common_codec import (
    finish_reason_from_pb,
    finish_reason_to_pb,
    logprobs_from_pb,
    logprobs_to_pb,
    lora_from_pb,
    lora_to_pb,
    mm_list_from_pb,
    mm_to_pb,
    sampling_from_pb,
    sampling_to_pb,
)
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason
from pagoda.contract.step import WorkerInfo
from pagoda.v1 import common_pb2, engine_pb2
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.request import EngineRequest, KvHandoff


def request_from_pb(pb: engine_pb2.GenerateRequest, arrival_time: float,
                    vocab_size: int = 0) -> EngineRequest:
    """Raises InvalidRequestError on bad sampling params, or on a token id outside the vocabulary
    (`vocab_size` > 0): the model would fail on it every step, and every resync would retry it.
    An empty id gets a fresh one."""
    if vocab_size and any(t >= vocab_size for t in pb.prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    return EngineRequest(
        request_id=RequestId(pb.request_id or f"req-{uuid.uuid4().hex}"),
        prompt_token_ids=tuple(pb.prompt_token_ids), sampling=sampling_from_pb(pb.sampling),
        arrival_time=arrival_time, priority=pb.priority, cache_salt=pb.cache_salt or None,
        lora=lora_from_pb(pb), num_prior_output_tokens=pb.num_prior_output_tokens,
        session_id=pb.session_id or None, session_ttl=pb.session_ttl_s, tenant=pb.tenant,
        kv_share=pb.kv_share,
        kv_import=handoff_from_pb(pb.kv_import) if pb.HasField("kv_import") else None,
        mm_inputs=mm_list_from_pb(pb.mm_inputs))


def handoff_from_pb(pb: common_pb2.KvHandoff) -> KvHandoff:
    return KvHandoff(pb.migration_id, pb.num_tokens, pb.num_blocks, source=pb.source)


def handoff_to_pb(handoff: KvHandoff) -> common_pb2.KvHandoff:
    return common_pb2.KvHandoff(migration_id=handoff.migration_id, num_tokens=handoff.num_tokens,
                                num_blocks=handoff.num_blocks, source=handoff.source)


def request_to_pb(request: EngineRequest) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_to_pb(request.sampling), priority=request.priority,
        cache_salt=request.cache_salt or "", lora=lora_to_pb(request.lora),
        num_prior_output_tokens=request.num_prior_output_tokens,
        session_id=request.session_id or "", session_ttl_s=request.session_ttl, tenant=request.tenant,
        kv_share=request.kv_share, mm_inputs=[mm_to_pb(m) for m in request.mm_inputs])


def delta_to_pb(delta: SequenceDelta) -> engine_pb2.SequenceDelta:
    return engine_pb2.SequenceDelta(
        index=delta.seq_index, token_ids=delta.new_token_ids,
        logprobs=[logprobs_to_pb(lp) for lp in delta.new_logprobs],
        finish_reason=finish_reason_to_pb(delta.finish_reason))


def delta_from_pb(pb: engine_pb2.SequenceDelta, request_id: str) -> SequenceDelta:
    return SequenceDelta(
        request_id=RequestId(request_id), seq_index=pb.index, new_token_ids=list(pb.token_ids),
        new_logprobs=[logprobs_from_pb(lp) for lp in pb.logprobs],
        finish_reason=finish_reason_from_pb(pb.finish_reason))


def response_to_pb(request_id: str, deltas: Iterable[SequenceDelta], finished: bool,
                   queue_seconds: float = 0.0,
                   timings: common_pb2.RequestTimings | None = None) -> engine_pb2.GenerateResponse:
    deltas = list(deltas)
    first = deltas[0] if deltas else None
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), ())
    handoff = next((d.migration for d in deltas if d.migration is not None), None)
    return engine_pb2.GenerateResponse(
        request_id=request_id, sequences=[delta_to_pb(d) for d in deltas],
        num_prompt_tokens=first.num_prompt_tokens if first else 0,
        num_cached_tokens=first.num_cached_tokens if first else 0,
        queue_seconds=queue_seconds, finished=finished,
        prompt_logprobs=[logprobs_to_pb(lp) for lp in prompt_logprobs], timings=timings,
        embedding=next((d.embedding for d in deltas if d.embedding), ()),
        kv_export=handoff_to_pb(handoff) if handoff is not None else None)


def finish_reason_name(reason: FinishReason | None) -> str:
    return reason.value if reason is not None else "none"


def info_to_pb(info: WorkerInfo, config: SchedulerConfig) -> engine_pb2.EngineInfo:
    return engine_pb2.EngineInfo(
        model_name=info.model_name, max_model_len=config.max_model_len,
        block_size=config.block_size, num_blocks=config.num_blocks,
        eos_token_ids=config.eos_token_ids, vocab_size=info.vocab_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        max_waiting_requests=config.max_waiting_requests, max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank)


# SchedulerStats attribute -> EngineStats field (the names differ only where listed).
_STATS_FIELDS = {
    "num_running": "num_running", "num_waiting": "num_waiting",
    "num_free_blocks": "num_free_blocks", "num_evictable_blocks": "num_evictable_blocks",
    "num_used_blocks": "num_used_blocks", "num_total_blocks": "num_total_blocks",
    "kv_usage": "kv_cache_usage", "prefix_queries": "prefix_cache_queries",
    "prefix_hits": "prefix_cache_hits", "num_preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens", "generation_tokens": "generation_tokens",
    "blocks_allocated": "blocks_allocated", "blocks_freed": "blocks_freed",
    "num_step_failures": "num_step_failures", "num_requests_isolated": "num_requests_isolated",
    "spec_num_drafts": "spec_num_drafts", "spec_num_draft_tokens": "spec_num_draft_tokens",
    "spec_num_accepted_tokens": "spec_num_accepted_tokens", "num_pinned_blocks": "num_pinned_blocks",
    "brownout_active": "brownout_active", "brownout_entries": "brownout_entries",
    "brownout_capped_requests": "brownout_capped_requests", "max_loras": "max_loras",
    "num_swapped": "num_swapped", "num_swap_preemptions": "num_swap_preemptions",
    "blocks_swapped_out": "blocks_swapped_out", "blocks_swapped_in": "blocks_swapped_in",
    "num_cpu_blocks": "num_cpu_blocks", "cpu_kv_usage": "cpu_kv_cache_usage",
    "prefill_tokens_computed": "prefill_tokens_computed",
    "encoder_tokens": "encoder_tokens", "encoder_cache_hits": "encoder_cache_hits",
    "num_offload_blocks": "num_offload_blocks", "offload_kv_usage": "offload_kv_cache_usage",
    "blocks_offloaded": "blocks_offloaded", "blocks_loaded": "blocks_loaded",
    "blocks_offload_dropped": "blocks_offload_dropped", "num_sessions": "num_sessions",
    "num_session_blocks": "num_session_blocks",
    "num_disk_blocks": "num_disk_blocks", "disk_kv_usage": "disk_kv_cache_usage",
    "blocks_disk_written": "blocks_disk_written", "blocks_disk_loaded": "blocks_disk_loaded",
    "blocks_disk_dropped": "blocks_disk_dropped",
}


def stats_to_pb(core_stats: object, *, num_total_blocks: int, num_steps: int, idle: bool,
                invariant_ok: bool, request_success: Mapping[str, int], worker_connected: bool,
                step_seconds_sum: float) -> engine_pb2.EngineStats:
    pb = engine_pb2.EngineStats(
        num_total_blocks=num_total_blocks, num_steps=num_steps, idle=idle, invariant_ok=invariant_ok,
        request_success=dict(request_success), worker_connected=worker_connected,
        step_seconds_sum=step_seconds_sum)
    for attr, field in _STATS_FIELDS.items():
        value = getattr(core_stats, attr, None)  # counters the core does not keep stay 0
        if value is not None:
            setattr(pb, field, value)
    pb.spec_accepted_per_pos.extend(getattr(core_stats, "spec_accepted_per_pos", ()))
    for t in getattr(core_stats, "tenants", ()):  # core/tenants.py
        pb.tenant_blocks_held[t.tenant] = t.blocks_held
        pb.tenant_blocks_cap[t.tenant] = t.blocks_cap
        pb.tenant_prompt_tokens[t.tenant] = t.prompt_tokens
        pb.tenant_generation_tokens[t.tenant] = t.generation_tokens
        pb.tenant_requests_waiting[t.tenant] = t.num_waiting
        pb.tenant_virtual_tokens[t.tenant] = t.virtual_tokens
    pb.running_lora_adapters.extend(getattr(core_stats, "running_lora_adapters", ()))
    pb.waiting_lora_adapters.extend(getattr(core_stats, "waiting_lora_adapters", ()))
    return pb
