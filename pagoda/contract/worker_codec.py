"""The Steps wire codec: protobuf <-> the plan/result dataclasses, both directions.

The only module of the worker that imports both the protos and the core dataclasses. The
scheduler's worker client uses the same functions (plans out, results in), so the wire format is
defined once. Pure functions; domain classes never see protobuf.
"""

from __future__ import annotations

from pagoda.contract.common_codec import (
    logprobs_from_pb,
    logprobs_to_pb,
    lora_from_pb,
    lora_to_pb,
    mm_list_from_pb,
    mm_to_pb,
    sampling_from_pb,
    sampling_to_pb,
)
from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.prefix_hash import extra_keys_from_json, extra_keys_to_json
from pagoda.contract.step import (
    BeamUpdate,
    BlockCopy,
    DiskBlock,
    DiskLoad,
    DiskWrite,
    Embedding,
    Fork,
    KvExport,
    KvImport,
    ModelDraft,
    NewRequestData,
    PromptLogprobs,
    StepPlan,
    StepResult,
    TableUpdate,
    WorkerInfo,
)
from pagoda.v1 import common_pb2, worker_pb2

# -- step plans -------------------------------------------------------------------------------

def plan_to_pb(plan: StepPlan, epoch: int) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=plan.step_id, epoch=epoch,
        new_requests=[_new_request_to_pb(r) for r in plan.new_requests],
        finished_ids=plan.finished_ids, preempted_ids=plan.preempted_ids,
        table_updates=[worker_pb2.TableUpdate(request_id=u.request_id, start=u.start,
                                              block_ids=u.block_ids) for u in plan.table_updates],
        num_scheduled_tokens=plan.num_scheduled_tokens,
        block_copies=_copies_to_pb(plan.block_copies),
        forks=[worker_pb2.Fork(parent_id=f.parent_id, child_ids=f.child_ids) for f in plan.forks],
        traceparent=plan.traceparent,
        draft_token_ids={rid: worker_pb2.DraftTokens(token_ids=ids) for rid, ids in plan.draft_token_ids.items()},
        beam_updates=[worker_pb2.BeamUpdate(request_id=u.request_id, parent_id=u.parent_id,
                                            token_id=u.token_id) for u in plan.beam_updates],
        swap_out=_copies_to_pb(plan.swap_out), swap_in=_copies_to_pb(plan.swap_in),
        disk_deletes=plan.disk_deletes,
        disk_writes=[worker_pb2.DiskWrite(src=w.src, block=disk_block_to_pb(w.block),
                                                 from_device=w.from_device) for w in plan.disk_writes],
        disk_loads=[worker_pb2.DiskLoad(block_hash=d.block_hash, dst=d.dst) for d in plan.disk_loads],
        kv_exports=[worker_pb2.KvExport(request_id=e.request_id, migration_id=e.migration_id,
                                        block_ids=e.block_ids, num_tokens=e.num_tokens, snapshot=e.snapshot,
                                        token_ids=e.token_ids) for e in plan.kv_exports],
        kv_imports=[worker_pb2.KvImport(request_id=i.request_id, migration_id=i.migration_id,
                                        first_block=i.first_block, block_ids=i.block_ids,
                                        num_tokens=i.num_tokens, snapshot=i.snapshot) for i in plan.kv_imports],
        model_drafts=[worker_pb2.ModelDraft(request_id=d.request_id, num_drafts=d.num_drafts,
                                            num_computed=d.num_computed, table_start=d.table_start,
                                            block_ids=d.block_ids) for d in plan.model_drafts])


def plan_from_pb(pb: worker_pb2.StepPlan) -> tuple[int, StepPlan]:
    """(epoch, plan)."""
    plan = StepPlan(
        step_id=pb.step_id,
        new_requests=[_new_request_from_pb(r) for r in pb.new_requests],
        finished_ids=[RequestId(i) for i in pb.finished_ids],
        preempted_ids=[RequestId(i) for i in pb.preempted_ids],
        table_updates=[TableUpdate(RequestId(u.request_id), u.start, [BlockId(b) for b in u.block_ids])
                       for u in pb.table_updates],
        num_scheduled_tokens={RequestId(k): v for k, v in pb.num_scheduled_tokens.items()},
        block_copies=_copies_from_pb(pb.block_copies),
        forks=[Fork(RequestId(f.parent_id), [RequestId(c) for c in f.child_ids]) for f in pb.forks],
        traceparent=pb.traceparent,
        draft_token_ids={RequestId(k): list(v.token_ids) for k, v in pb.draft_token_ids.items()},
        beam_updates=[BeamUpdate(RequestId(u.request_id), RequestId(u.parent_id), u.token_id)
                      for u in pb.beam_updates],
        swap_out=_copies_from_pb(pb.swap_out), swap_in=_copies_from_pb(pb.swap_in),
        disk_deletes=list(pb.disk_deletes),
        disk_writes=[DiskWrite(w.src, disk_block_from_pb(w.block), w.from_device) for w in pb.disk_writes],
        disk_loads=[DiskLoad(d.block_hash, BlockId(d.dst)) for d in pb.disk_loads],
        kv_exports=[KvExport(RequestId(e.request_id), e.migration_id, [BlockId(b) for b in e.block_ids],
                             e.num_tokens, e.snapshot, tuple(e.token_ids)) for e in pb.kv_exports],
        kv_imports=[KvImport(RequestId(i.request_id), i.migration_id, i.first_block,
                             [BlockId(b) for b in i.block_ids], i.num_tokens, i.snapshot) for i in pb.kv_imports],
        model_drafts=[ModelDraft(RequestId(d.request_id), d.num_drafts, d.num_computed, d.table_start,
                                 [BlockId(b) for b in d.block_ids]) for d in pb.model_drafts])
    return pb.epoch, plan


def disk_block_to_pb(block: DiskBlock) -> worker_pb2.DiskBlock:
    return worker_pb2.DiskBlock(block_hash=block.block_hash, token_ids=block.token_ids,
                                extra_keys_json=extra_keys_to_json(block.extra_keys))


def disk_block_from_pb(pb: worker_pb2.DiskBlock) -> DiskBlock:
    return DiskBlock(pb.block_hash, tuple(pb.token_ids), extra_keys_from_json(pb.extra_keys_json))


def _copies_to_pb(copies: list[BlockCopy]) -> list[worker_pb2.BlockCopy]:
    return [worker_pb2.BlockCopy(src=c.src, dst=c.dst) for c in copies]


def _copies_from_pb(copies) -> list[BlockCopy]:
    return [BlockCopy(BlockId(c.src), BlockId(c.dst)) for c in copies]


def _new_request_to_pb(r: NewRequestData) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        request_id=r.request_id, token_ids=r.token_ids, num_prompt_tokens=r.num_prompt_tokens,
        block_ids=r.block_ids, num_computed_tokens=r.num_computed_tokens,
        num_scheduled_tokens=r.num_scheduled_tokens, sampling=sampling_to_pb(r.sampling),
        seq_index=r.seq_index, lora=lora_to_pb(r.lora), mm_inputs=[mm_to_pb(m) for m in r.mm_inputs])


def _new_request_from_pb(pb: worker_pb2.NewRequest) -> NewRequestData:
    return NewRequestData(
        request_id=RequestId(pb.request_id), token_ids=list(pb.token_ids),
        num_prompt_tokens=pb.num_prompt_tokens, block_ids=[BlockId(b) for b in pb.block_ids],
        num_computed_tokens=pb.num_computed_tokens, num_scheduled_tokens=pb.num_scheduled_tokens,
        sampling=sampling_from_pb(pb.sampling), seq_index=pb.seq_index, lora=lora_from_pb(pb),
        mm_inputs=mm_list_from_pb(pb.mm_inputs))


# -- step results -----------------------------------------------------------------------------

def result_to_pb(result: StepResult) -> worker_pb2.StepResult:
    # logprobs is "empty, or parallel to token_ids": a row without logprobs is sent as an empty one.
    logprobs = ([logprobs_to_pb(lp) if lp is not None else common_pb2.TokenLogprobs()
                 for lp in result.logprobs] if any(lp is not None for lp in result.logprobs) else [])
    return worker_pb2.StepResult(
        step_id=result.step_id, request_ids=result.request_ids, token_ids=result.token_ids,
        logprobs=logprobs, forward_seconds=result.forward_seconds,
        sample_seconds=result.sample_seconds,
        prompt_logprobs=[worker_pb2.PromptLogprobs(
            request_id=p.request_id, start=p.start, logprobs=[logprobs_to_pb(lp) for lp in p.logprobs])
            for p in result.prompt_logprobs],
        embeddings=[worker_pb2.Embedding(request_id=e.request_id, values=e.values) for e in result.embeddings],
        num_encoder_tokens=result.num_encoder_tokens, num_encoder_cache_hits=result.num_encoder_cache_hits)


def result_from_pb(pb: worker_pb2.StepResult) -> StepResult:
    """Only for results without `error` (the caller checks `pb.HasField("error")` first)."""
    return StepResult(
        step_id=pb.step_id, request_ids=[RequestId(i) for i in pb.request_ids],
        token_ids=list(pb.token_ids), logprobs=[logprobs_from_pb(lp) for lp in pb.logprobs],
        forward_seconds=pb.forward_seconds, sample_seconds=pb.sample_seconds,
        prompt_logprobs=[PromptLogprobs(RequestId(p.request_id), p.start,
                                        [logprobs_from_pb(lp) for lp in p.logprobs])
                         for p in pb.prompt_logprobs],
        embeddings=[Embedding(RequestId(e.request_id), list(e.values)) for e in pb.embeddings],
        num_encoder_tokens=pb.num_encoder_tokens, num_encoder_cache_hits=pb.num_encoder_cache_hits)


def error_result_pb(step_id: int, code: int, message: str) -> worker_pb2.StepResult:
    return worker_pb2.StepResult(step_id=step_id,
                                 error=worker_pb2.StepError(code=code, message=message))


# -- Init ------------------------------------------------------------------------------------

def info_to_pb(info: WorkerInfo, epoch: int) -> worker_pb2.InitResponse:
    return worker_pb2.InitResponse(
        num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
        eos_token_ids=info.eos_token_ids, epoch=epoch, vocab_size=info.vocab_size,
        model_name=info.model_name, max_loras=info.max_loras, max_lora_rank=info.max_lora_rank,
        num_cpu_blocks=info.num_cpu_blocks, sliding_window=info.sliding_window,
        num_offload_blocks=info.num_offload_blocks, num_disk_blocks=info.num_disk_blocks,
        disk_blocks=[disk_block_to_pb(b) for b in info.disk_blocks], kv_migration=info.kv_migration,
        kv_snapshot_dir=info.kv_snapshot_dir, pipeline_parallel_size=info.pipeline_parallel_size,
        kv_transfer_address=info.kv_transfer_address)


def info_from_pb(pb: worker_pb2.InitResponse) -> tuple[int, WorkerInfo]:
    """(epoch, info)."""
    return pb.epoch, WorkerInfo(
        num_blocks=pb.num_blocks, block_size=pb.block_size, max_model_len=pb.max_model_len,
        eos_token_ids=tuple(pb.eos_token_ids), vocab_size=pb.vocab_size, model_name=pb.model_name,
        max_loras=pb.max_loras, max_lora_rank=pb.max_lora_rank, num_cpu_blocks=pb.num_cpu_blocks,
        sliding_window=pb.sliding_window, num_offload_blocks=pb.num_offload_blocks,
        num_disk_blocks=pb.num_disk_blocks, disk_blocks=tuple(disk_block_from_pb(b) for b in pb.disk_blocks),
        kv_migration=pb.kv_migration, kv_snapshot_dir=pb.kv_snapshot_dir,
        pipeline_parallel_size=max(1, pb.pipeline_parallel_size),
        kv_transfer_address=pb.kv_transfer_address)
