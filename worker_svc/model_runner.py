"""The model runner: applies step plans to the resident state, runs the forward pass, samples.

Steps are applied strictly in order. `validate` checks a whole plan before anything changes, so a
bad plan leaves the worker exactly as it was (the scheduler then resyncs).

Under tensor parallelism one ModelRunner runs per rank over its shard (worker_svc/parallel/tp_worker.py
drives them). Every rank applies every plan and runs the forward; only rank 0 (the driver)
computes logits and samples. A follower keeps the states that sampled (`unsampled`, by step) and
gets their tokens from rank 0 with a later plan (`append_sampled`), before that plan is applied.

Under pipeline parallelism (worker_svc/parallel/pipeline.py) each stage's runner holds its layers and their
KV; a later stage takes the previous one's hidden states, the last stage's TP rank 0 samples and
sends rank 0 the result. Every other rank is a follower in the sense above.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kernels import default_backend_name, get_backend
from kernels.kv_cache_dtype import resolve_cache_dtype
from pagoda.contract.errors import NotInitializedError, PlanError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import Fork, PromptLogprobs, StepPlan, StepResult, WorkerInfo
from pagoda.runtime.logging import get_logger
from pagoda.runtime.model_files import is_gguf_file
from worker_svc import fault_injection
from worker_svc.config import WorkerConfig
from worker_svc.disk_tier.block_file import BlockFileRefused, model_fingerprint
from worker_svc.disk_tier.migration import MigrationStore
from worker_svc.disk_tier.snapshots import KvFiles, SnapshotStore
from worker_svc.disk_tier.store import DiskStore, num_disk_blocks
from worker_svc.draft_model import DraftModel
from worker_svc.input_batch import (
    CachedRequestState,
    DecodeInputBuffers,
    ScheduledSeq,
    apply_beam_updates,
    build_model_inputs,
)
from worker_svc.kv_cache import (
    CacheShape,
    HostKVPool,
    KVCache,
    cpu_num_blocks,
    cuda_num_blocks,
    num_blocks_for_budget,
    raw_view,
)
from worker_svc.kv_cache import num_cpu_blocks as num_host_blocks_for
from worker_svc.kv_transfer.store import migration_transport
from worker_svc.lora.manager import LoRAManager
from worker_svc.model_loader import gguf_loader
from worker_svc.model_loader.loader import load_model, resolve_dtype
from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.models.batch_invariant_linear import make_linears_batch_invariant
from worker_svc.models.batch_invariant_linear import uses_amx as batch_invariant_uses_amx
from worker_svc.models.fused_decode import Setting as FusedSetting
from worker_svc.models.fused_decode import fused_decode_for
from worker_svc.models.packed_linear import PackedLinear, can_pack, pack_linear_weights
from worker_svc.models.quant_linear import QuantLinear, int8_dot_status
from worker_svc.models.row_buckets import bucket_linear_rows, release_free_heap, warm_row_buckets
from worker_svc.multimodal import MultiModalEmbedder
from worker_svc.parallel.distributed import SINGLE, TensorParallel
from worker_svc.parallel.pipeline import SINGLE_STAGE, PipelineStage
from worker_svc.plan_validation import validate_plan
from worker_svc.pooling import pool_embeddings
from worker_svc.prompt_logprobs import compute_prompt_logprobs, plan_prompt_rows
from worker_svc.sampler import Sampler, SamplingRow
from worker_svc.spec_verify import DraftVerifier
from worker_svc.structured_output import GrammarCompiler, GrammarState

log = get_logger(__name__)

PROFILE_SAMPLING_ROWS = 256  # logits rows the memory profile samples (a full decode batch)
MAX_BUFFERED_DECODE_SEQS = 256  # decode steps up to this batch build their inputs in fixed buffers


@dataclass(slots=True)
class StepMarks:
    """perf_counter() instants of the last step that ran a forward (pagoda/runtime/step_timeline.py):
    execute's start, inputs built, logits computed, tokens sampled. Four clock reads a step."""

    started: float = 0.0
    inputs_built: float = 0.0
    logits_done: float = 0.0
    sampled: float = 0.0


def resolve_device(name: str, tp_rank: int = 0, tp_size: int = 1) -> torch.device:
    """Under TP on CUDA, rank r takes the r-th visible GPU (choose them with CUDA_VISIBLE_DEVICES)."""
    device = torch.device("cuda" if name == "auto" and torch.cuda.is_available() else
                          "cpu" if name == "auto" else name)
    if device.type == "cuda" and tp_size > 1:  # a rank of a multi-node world: its node's GPU
        return torch.device("cuda", tp_rank % max(1, torch.cuda.device_count()))
    return device


class ModelRunner:
    def __init__(self, config: WorkerConfig, max_num_batched_tokens: int = 8192,
                 tp: TensorParallel = SINGLE, stage: PipelineStage = SINGLE_STAGE) -> None:
        if config.tensor_parallel_size != tp.size or config.pipeline_parallel_size != stage.size:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} x pipeline_parallel_size "
                             f"{config.pipeline_parallel_size} needs a group of that size: build it with "
                             "worker_svc.parallel.tp_worker.create_runner")
        self.config = config
        self.tp = tp
        self.stage = stage
        self.samples = tp.is_driver and stage.is_last  # the one rank that computes logits and samples
        self._reports = self.samples and stage.size > 1  # sends rank 0 each step's result
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = MAX_BUFFERED_DECODE_SEQS  # the scheduler's (Init), for the row buckets to warm
        self._buckets_warm = False
        self.device = resolve_device(config.device, stage.world_rank, tp.size * stage.size)
        with gguf_loader.shared_readers():  # the config read here and the load: one parse of a GGUF
            self.dtype = resolve_dtype(config.dtype, ModelConfig.from_dir(config.model))
            self.quantization = self._resolve_quantization()
            self.model, self.model_config = load_model(config.model, self.dtype, self.device, tp,
                                                       self.quantization, stage)
        if config.batch_invariant:
            self._make_batch_invariant()
        elif config.pack_weights and tp.size == 1 and self.device.type == "cpu":
            self._pack_weights()
        self.lora = (LoRAManager(self.model, self.model_config, config.max_loras, config.max_lora_rank,
                                 config.max_cpu_loras, self.dtype, self.device, tp)
                     if config.enable_lora else None)  # wraps the (packed) projections
        backend = config.attention_backend
        self.backend = get_backend(default_backend_name(self.device, self.dtype) if backend == "auto" else backend)
        if self.device.type == "cuda" and self.backend.name == "torch":
            log.info("attention_backend_torch", dtype=str(self.dtype),
                     why="the CuPy kernels are fp16/bf16: this run reads its cache through the torch reference")
        self.max_model_len = self._resolve_max_model_len()
        self.cache_dtype = resolve_cache_dtype(config.kv_cache_dtype, self.dtype)
        self._install_fused_decode()
        if self.backend.name == "cupy":  # refuse at start a model the kernels have no variant for
            from kernels.paged_attention.cupy_impl import KernelShape

            mc = self.model_config  # FP8 caches have variants; fp32 activations, odd head_dims do not
            KernelShape(self.dtype, mc.head_dim, config.block_size, mc.num_heads // mc.num_kv_heads,
                        self.cache_dtype).validate()
        self.mm = self._load_vision()  # None: a text-only model
        self.sampler = Sampler(self.model_config.eos_token_ids, self.device, config.seed)
        # Structured outputs: only the rank that samples keeps grammars (compiled off the loop).
        self.grammars = (GrammarCompiler(config.model, self.model_config.vocab_size,
                                         self.model_config.eos_token_ids) if self.samples else None)
        self.verifier = DraftVerifier(self.sampler, config.seed)
        self.drafter = self._load_draft_model() if config.speculative_model else None
        self._draft_probs: dict[RequestId, torch.Tensor] = {}  # this step's, by request (random rows)
        self.requests: dict[RequestId, CachedRequestState] = {}
        self.kv_cache: KVCache | None = None
        self._decode_buffers: DecodeInputBuffers | None = None  # made with the cache (initialize)
        self.host_pool: HostKVPool | None = None  # --swap-space: swapped-out blocks
        self.disk: DiskStore | None = None  # --kv-offload-dir: the prefix cache's disk tier
        self._disk_payloads: list[torch.Tensor] = []  # the validated plan's disk loads, read
        self.migration: MigrationStore | None = None  # --kv-migrate-dir: live migration's files
        self._import_payloads: list[torch.Tensor] = []  # the validated plan's migrated blocks, read
        self._last_step_id: int | None = None
        # A follower's sampling states (and drafted sequences) by step id, awaiting the tokens the
        # sampling rank drew (and the drafts it accepted)
        self.unsampled: dict[int, tuple[list[CachedRequestState], list[tuple[CachedRequestState, list[int]]]]] = {}
        self._embeddings: list = []  # the pooling requests' vectors of the step being executed
        self.marks = StepMarks()  # the last step's instants, for the worker's step timeline

    # -- lifecycle ------------------------------------------------------------------------------

    def initialize(self) -> WorkerInfo:
        """Profile memory (CUDA), allocate the KV cache, and say what the scheduler may use."""
        shape = CacheShape(len(self.stage.layers(self.model_config.num_layers)), self.config.block_size,
                           self.model_config.num_kv_heads // self.tp.size,  # this rank's heads
                           self.model_config.head_dim, self.cache_dtype)
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override
        elif self.config.kv_cache_memory_bytes is not None:  # a byte budget on any device (as vLLM's)
            num_blocks = num_blocks_for_budget(self.config.kv_cache_memory_bytes, shape)
        elif self.device.type == "cuda":
            peak = self._profile_peak_memory(shape)
            num_blocks = cuda_num_blocks(self.device, self.config.gpu_memory_utilization, shape, peak)
        else:
            num_blocks = cpu_num_blocks(self.config.kv_cache_memory_bytes, shape, self.max_model_len)
        if self._grouped:  # block ids mean the same slots on every rank
            num_blocks = self.tp.min_over_ranks(num_blocks)
        if self.drafter is not None and self.config.num_gpu_blocks_override is None:
            # Every block id has storage in both caches: the budget sized for the target's alone
            # is split by the two models' bytes per block.
            target_bytes, draft_bytes = shape.bytes_per_block, self.drafter.shape.bytes_per_block
            num_blocks = max(1, num_blocks * target_bytes // (target_bytes + draft_bytes))
        num_host_blocks = num_host_blocks_for(self.config.swap_space, shape)
        # The prefix cache's host tier shares the host pool, after the swap space's blocks.
        num_offload_blocks = num_host_blocks_for(self.config.kv_offloading_size / self.tp.size, shape)
        if self._grouped:
            num_host_blocks = self.tp.min_over_ranks(num_host_blocks)
            num_offload_blocks = self.tp.min_over_ranks(num_offload_blocks)
        self.kv_cache = self.host_pool = None  # free the old caches before allocating new ones
        self.kv_cache = KVCache(shape, num_blocks, self.device)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks)
        self._decode_buffers = DecodeInputBuffers(
            min(self.max_num_batched_tokens, MAX_BUFFERED_DECODE_SEQS),
            math.ceil(self.max_model_len / self.config.block_size), self.device)
        if num_host_blocks + num_offload_blocks:
            self.host_pool = HostKVPool(shape, num_host_blocks + num_offload_blocks,
                                        pin_memory=self.device.type == "cuda")
        self.reset()
        self.disk = self._disk_store(shape, num_offload_blocks)
        self.migration = self._migration_store(shape)
        self._warm_row_buckets()
        return WorkerInfo(num_blocks=num_blocks, block_size=self.config.block_size,
                          max_model_len=self.max_model_len,
                          eos_token_ids=tuple(self.model_config.eos_token_ids),
                          vocab_size=self.model_config.vocab_size, model_name=self.config.model,
                          max_loras=self.lora.max_loras if self.lora else 0,
                          max_lora_rank=self.lora.max_lora_rank if self.lora else 0,
                          num_cpu_blocks=num_host_blocks, num_offload_blocks=num_offload_blocks,
                          sliding_window=self.model_config.kv_window,
                          num_disk_blocks=self.disk.capacity if self.disk else 0,
                          disk_blocks=self.disk.listing() if self.disk else (),
                          kv_migration=self.migration is not None and self.migration.migration is not None,
                          kv_snapshot_dir=str(self.snapshots.dir) if self.snapshots else "",
                          pipeline_parallel_size=self.stage.size,
                          kv_transfer_address=getattr(self.migration and self.migration.migration, "address", ""))

    @property
    def snapshots(self) -> SnapshotStore | None:
        return self.migration.snapshots if self.migration is not None else None

    def _migration_store(self, shape: CacheShape) -> KvFiles | None:
        """Live migration's folder (--kv-migrate-dir) and the session snapshots' (--kv-snapshot-dir);
        not with TP yet (each rank holds some heads)."""
        config = self.config
        if not (config.kv_migrate_dir or config.kv_snapshot_dir or config.kv_transfer == "grpc") or self._grouped:
            return None
        fingerprint = model_fingerprint(config.model, self.dtype, self.cache_dtype, str(self.quantization),
                                        shape.block_size, shape.num_layers, shape.num_kv_heads, shape.head_dim)
        return KvFiles(
            migration_transport(config, fingerprint, shape.block_size),  # the folder's or gRPC's (kv_transfer/)
            SnapshotStore(config.kv_snapshot_dir, fingerprint, shape.block_size) if config.kv_snapshot_dir else None)

    def _disk_store(self, shape: CacheShape, num_offload_blocks: int) -> DiskStore | None:
        """The disk tier's directory (--kv-offload-dir), under the host tier, whose drops it keeps."""
        config = self.config
        if not config.kv_offload_dir:
            return None
        if self.disk is not None:  # Init again (a reconnecting scheduler): the same directory, listed anew
            return self.disk
        if not num_offload_blocks:
            raise ValueError("--kv-offload-dir needs the host tier it sits under: set --kv-offloading-size")
        if self._grouped:
            raise ValueError("--kv-offload-dir with tensor or pipeline parallelism is not supported yet")
        fingerprint = model_fingerprint(config.model, self.dtype, self.cache_dtype, str(self.quantization),
                                        shape.block_size, shape.num_layers, shape.num_kv_heads, shape.head_dim)
        return DiskStore(config.kv_offload_dir, fingerprint,
                         num_disk_blocks(config.kv_offload_dir_size, shape.bytes_per_block))

    def close(self) -> None:
        """Release the disk tier's directory (the offline LLM's close; the process's end does it too)."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def reset(self) -> None:
        """Drop every resident request; the next plan may start at any step id."""
        self.requests.clear()
        if self.drafter is not None:
            self.drafter.tables.clear()
        self._last_step_id = None
        self.unsampled = {}

    @property
    def _grouped(self) -> bool:
        """One of several ranks (TP or PP): what they must agree on is taken over the group."""
        return self.tp.size > 1 or self.stage.size > 1

    @property
    def num_resident(self) -> int:
        return len(self.requests)

    # -- steps ----------------------------------------------------------------------------------

    def validate(self, plan: StepPlan) -> None:
        """Raise PlanError if `plan` cannot apply to the resident state; changes nothing."""
        if self.kv_cache is None:
            raise NotInitializedError("initialize() must run before any step")
        if self._last_step_id is not None and plan.step_id != self._last_step_id + 1:
            raise PlanError(f"step {plan.step_id} does not follow step {self._last_step_id}")
        validate_plan(plan, self.requests, self.kv_cache.num_blocks, self.config.block_size,
                      self.host_pool.num_blocks if self.host_pool is not None else 0, self.disk is not None)
        if plan.model_drafts:
            if self.drafter is None:
                raise PlanError("the plan asks for draft-model proposals but this worker has no draft "
                                "model: give the worker the same --speculative-config as the scheduler")
            self.drafter.check(plan.model_drafts, self.requests, self.kv_cache.num_blocks)
        if self.lora is None and any(new.lora is not None for new in plan.new_requests):
            raise PlanError("a request names a LoRA adapter but this worker runs without --enable-lora")
        if self.mm is None and any(new.mm_inputs for new in plan.new_requests):
            raise PlanError("a request carries images but this worker's model is not a vision-language model")
        if plan.disk_loads and self.disk is not None:  # read and verified before anything changes
            try:
                self._disk_payloads = self.disk.read(plan.disk_loads)
            except BlockFileRefused as error:
                raise PlanError(f"a disk tier file was refused: {error}") from error
        if plan.kv_exports or plan.kv_imports:
            self._validate_migration(plan)

    def _validate_migration(self, plan: StepPlan) -> None:
        """Exports name resident requests; imports are read and verified now (PlanError before
        anything changed, as disk loads)."""
        (self.migration or KvFiles(None, None)).check(plan.kv_exports, plan.kv_imports)  # each its folder
        assert self.migration is not None
        for export in plan.kv_exports:
            if export.snapshot:  # a session save: a lease's blocks, its tokens with it
                if len(export.token_ids) != export.num_tokens:
                    raise PlanError(f"session save {export.migration_id}: {len(export.token_ids)} token ids "
                                    f"for {export.num_tokens} tokens")
                continue
            state = self.requests.get(export.request_id)
            if state is None or export.num_tokens > len(state.token_ids):
                raise PlanError(f"KV export of {export.request_id!r}, not resident with {export.num_tokens} tokens")
        num_blocks = self.kv_cache.num_blocks  # type: ignore[union-attr]  # validate() checked
        blocks = [b for e in plan.kv_exports for b in e.block_ids] + [b for i in plan.kv_imports for b in i.block_ids]
        if any(not 0 <= b < num_blocks for b in blocks):
            raise PlanError(f"a KV export or import names a block out of range: {blocks}")
        new = {r.request_id: r.token_ids for r in plan.new_requests}
        if any(i.request_id not in new for i in plan.kv_imports):
            raise PlanError("a KV import for a request this plan does not start")
        self._import_payloads = self.migration.read(plan.kv_imports, new) if plan.kv_imports else []

    def execute(self, plan: StepPlan) -> StepResult:
        """Raises PlanError (before any change) for a plan that does not apply."""
        self.validate(plan)
        return self.execute_validated(plan)

    def execute_validated(self, plan: StepPlan) -> StepResult:
        """`execute` for a plan that `validate` accepted (TP rank 0 validates before broadcasting).
        A pipeline's last stage also sends the result to rank 0, which reports it."""
        result = self._execute_validated(plan)
        if self._reports:
            self.stage.send_result(result)
        return result

    def _execute_validated(self, plan: StepPlan) -> StepResult:
        self._last_step_id = plan.step_id
        seqs = self._apply(plan)
        result = StepResult(step_id=plan.step_id)
        if not seqs:
            return result
        fault_injection.check(seq.state.request_id for seq in seqs)  # no-op unless a test set it
        forks = {fork.parent_id: fork for fork in plan.forks}
        started = self.marks.started = time.perf_counter()
        drafts = self._model_drafts(plan) if plan.model_drafts else plan.draft_token_ids
        logits, rows, states, drafted, prompt_logprobs = self._forward(seqs, forks, drafts)
        result.prompt_logprobs = prompt_logprobs
        result.embeddings = self._embeddings
        if self.mm is not None:
            result.num_encoder_tokens, result.num_encoder_cache_hits = self.mm.take_step_counts()
        if logits is None:  # a follower: the sampling rank's tokens come with a later plan
            if states or drafted:
                self.unsampled[plan.step_id] = (states, drafted)
            return result
        sampled_at = self._sync_clock()
        output = self.sampler(logits[:len(rows)], rows)
        for state, token in zip(states, output.token_ids, strict=True):
            state.token_ids.append(token)
        result.request_ids = [state.request_id for state in states]
        result.token_ids = output.token_ids
        result.logprobs = output.logprobs
        if drafted:
            self._verify_drafts(logits[len(rows):], drafted, result)
        result.forward_seconds = sampled_at - started
        self.marks.sampled = time.perf_counter()
        result.sample_seconds = self.marks.sampled - sampled_at
        return result

    def _model_drafts(self, plan: StepPlan) -> dict[RequestId, list[int]]:
        """The draft model's proposals (timed with the step: the speculation policy's cost fit
        must see what drafting costs), placed after each request's last token like n-gram drafts."""
        assert self.drafter is not None
        proposed, self._draft_probs = self.drafter.propose([(self.requests[d.request_id], d)
                                                            for d in plan.model_drafts])
        for request_id, tokens in proposed.items():
            self.requests[request_id].token_ids.extend(tokens)
        return {**plan.draft_token_ids, **proposed}

    def _load_draft_model(self) -> DraftModel:
        if self._grouped or self.lora is not None:
            raise ValueError("a draft model (--speculative-config's model) runs on a single worker "
                             "without tensor/pipeline parallelism or LoRA")
        return DraftModel(self.config.speculative_model, self.config.model,  # type: ignore[arg-type]
                          self.model_config.vocab_size, self.dtype, self.device, self.backend,
                          self.config.block_size, self.config.pack_weights,
                          tuple(self.model_config.eos_token_ids), self.config.seed)

    def _verify_drafts(self, logits: torch.Tensor, drafted: list[tuple[CachedRequestState, list[int]]],
                       result: StepResult) -> None:
        """Keep each drafted sequence's accepted drafts plus its own token; roll back the rest: its
        tokens, num_computed, and its table cut to the blocks of positions <= num_computed (as the
        scheduler cuts its copy)."""
        items = []
        for state, drafts in drafted:
            history = len(state.token_ids) - len(drafts)
            items.append((SamplingRow(state.sampling, state.token_ids[:history], state.num_prompt_tokens,
                                      state.seq_index, state.grammar), drafts))
        probs = [self._draft_probs.get(state.request_id) for state, _ in drafted] if self._draft_probs else None
        self._draft_probs = {}
        for (state, drafts), tokens in zip(drafted, self.verifier(logits, items, probs), strict=True):
            self._settle_drafts(state, drafts, tokens)
            result.request_ids.extend([state.request_id] * len(tokens))
            result.token_ids.extend(tokens)
            if result.logprobs:  # drafted requests never ask for logprobs: keep the list parallel
                result.logprobs.extend([None] * len(tokens))

    def _settle_drafts(self, state: CachedRequestState, drafts: list[int], tokens: list[int]) -> None:
        """A drafted sequence keeps `tokens` (its accepted drafts and its own) in place of its drafts."""
        history = len(state.token_ids) - len(drafts)
        del state.token_ids[history:]
        state.token_ids.extend(tokens)
        state.num_computed_tokens = len(state.token_ids) - 1
        del state.block_ids[state.num_computed_tokens // self.config.block_size + 1:]

    def append_sampled(self, sampled: list[tuple[int, list[int], list[RequestId] | None]]) -> None:
        """Follower: (step id, tokens, their request ids when the step verified drafts) the sampling
        rank drew for `unsampled[step id]`, in order: first one token per sampling state, then
        each drafted sequence's kept tokens."""
        for step_id, token_ids, request_ids in sampled:
            entry = self.unsampled.pop(step_id, None)
            if entry is None:  # the sampling rank itself, or tokens this rank appended already
                continue
            states, drafted = entry
            for state, token in zip(states, token_ids[:len(states)], strict=True):
                state.token_ids.append(token)
            if drafted:
                kept: dict[RequestId, list[int]] = {}
                for rid, token in zip(request_ids[len(states):], token_ids[len(states):], strict=True):
                    kept.setdefault(rid, []).append(token)
                for state, drafts in drafted:
                    self._settle_drafts(state, drafts, kept[state.request_id])

    def _apply(self, plan: StepPlan) -> list[ScheduledSeq]:
        """Apply the plan's changes; return the sequences computed this step, in resident order."""
        if plan.kv_exports:  # first of all: the finished ids below drop these requests' tokens
            assert self.migration is not None and self.kv_cache is not None  # _validate_migration checked
            self.migration.export(raw_view(self.kv_cache.storage), plan.kv_exports,
                                  {e.request_id: self.requests[e.request_id].token_ids for e in plan.kv_exports
                                   if not e.snapshot})
        if plan.beam_updates:  # first: a beam the plan drops may still be another one's parent
            apply_beam_updates(self.requests, plan.beam_updates)
        for request_id in (*plan.finished_ids, *plan.preempted_ids):
            del self.requests[request_id]
            if self.drafter is not None:
                self.drafter.drop(request_id)
        counts = dict(plan.num_scheduled_tokens)
        for new in plan.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                new.num_computed_tokens, new.sampling, new.seq_index, self._grammar(new.sampling),
                new.lora, mm_inputs=new.mm_inputs)
            counts[new.request_id] = new.num_scheduled_tokens
        for update in plan.table_updates:
            table = self.requests[update.request_id].block_ids
            table[update.start:update.start + len(update.block_ids)] = update.block_ids
        for request_id, drafts in plan.draft_token_ids.items():  # computed after its own tokens
            self.requests[request_id].token_ids.extend(drafts)
        if plan.disk_deletes or plan.disk_writes:  # before the swap-outs that refill the host slots
            assert self.disk is not None and self.host_pool is not None and self.kv_cache is not None
            self.disk.delete_and_write(raw_view(self.host_pool.storage), raw_view(self.kv_cache.storage),
                                       plan.disk_deletes, plan.disk_writes)
        if plan.swap_out or plan.swap_in:  # before the copies: the blocks swap-outs free may be reused
            assert self.kv_cache is not None and self.host_pool is not None  # validate_plan checked
            self.host_pool.apply(self.kv_cache, plan.swap_out, plan.swap_in)
        if plan.disk_loads:  # after the swap-outs that saved these device blocks' old content
            assert self.disk is not None and self.kv_cache is not None
            self.disk.place(raw_view(self.kv_cache.storage), plan.disk_loads, self._disk_payloads)
            self._disk_payloads = []
        if plan.kv_imports:  # with the disk loads: fresh blocks of new requests, read at validation
            assert self.migration is not None and self.kv_cache is not None
            self.migration.place(raw_view(self.kv_cache.storage), plan.kv_imports, self._import_payloads)
            self._import_payloads = []
        if plan.block_copies:
            assert self.kv_cache is not None
            self.kv_cache.copy_blocks([c.src for c in plan.block_copies],
                                      [c.dst for c in plan.block_copies])
        scheduled = ((state, counts.get(rid, 1)) for rid, state in self.requests.items())
        return [ScheduledSeq(state, n) for state, n in scheduled if n > 0]

    @torch.inference_mode()
    def _forward(self, seqs: list[ScheduledSeq], forks: dict[RequestId, Fork],
                 drafts: dict[RequestId, list[int]]
                 ) -> tuple[torch.Tensor | None, list[SamplingRow], list[CachedRequestState],
                            list[tuple[CachedRequestState, list[int]]], list[PromptLogprobs]]:
        """Forward every scheduled token. Logits [N, V] (None on a TP follower, which never
        samples): first one row per sampling sequence (`rows`, `states`), then, per sequence with
        drafts (`drafted`), its K+1 rows: after its last token and after each draft. Last, the
        prompt logprobs of the prefill chunks that ask for them (prompt_logprobs.py; rank 0 only).

        A fork's children sample from the parent's final-prompt logits row (repeated), each with
        its own seq_index; they become resident here as copies of the parent before its token.
        """
        assert self.kv_cache is not None
        if self.lora is not None:  # grouped by adapter: each adapter's rows become one block
            seqs = self.lora.prepare(seqs)
        inputs = self._build_inputs(seqs)
        self.marks.inputs_built = time.perf_counter()
        try:
            hidden = self._stage_forward(inputs, seqs)
        finally:
            if self.lora is not None:
                self.lora.finish_step()
        prompt_rows = plan_prompt_rows(seqs, inputs.last_rows) if self.samples else []
        # Before num_computed advances (it tells the last chunk); every rank's hidden is whole.
        self._embeddings = (pool_embeddings(seqs, hidden, inputs.last_rows, self.config.pooling_type,
                                            self.config.normalize_embeddings) if self.samples else [])
        logit_rows: list[int] = []
        rows: list[SamplingRow] = []
        states: list[CachedRequestState] = []
        drafted: list[tuple[CachedRequestState, list[int]]] = []
        draft_rows: list[int] = []  # flat token rows
        for i, seq in enumerate(seqs):
            state = seq.state
            state.num_computed_tokens += seq.num_tokens
            if state.num_computed_tokens != len(state.token_ids):
                continue  # a prefill chunk that is not the last: nothing to sample
            if drafts and state.request_id in drafts:
                last = int(inputs.last_rows[i])
                state_drafts = drafts[state.request_id]
                draft_rows.extend(range(last - len(state_drafts), last + 1))
                drafted.append((state, state_drafts))
                continue
            family = [state]
            fork = forks.get(state.request_id)
            if fork is not None:
                family += [state.fork(child, seq_index=j + 1) for j, child in enumerate(fork.child_ids)]
            for member in family:
                self.requests[member.request_id] = member
                logit_rows.append(i)
                rows.append(member.sampling_row())
                states.append(member)
        if not self.samples:
            return None, rows, states, drafted, []
        sampled_hidden = self._logit_hidden(hidden, inputs, logit_rows, draft_rows)  # [N, hidden]
        logits = self.model.compute_logits(sampled_hidden).float()  # [N, V]
        self.marks.logits_done = time.perf_counter()
        prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, prompt_rows)
        return logits, rows, states, drafted, prompt_logprobs

    # -- helpers --------------------------------------------------------------------------------

    def _stage_forward(self, inputs, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """This stage's layers over the step's tokens: from the token ids on the first stage, from
        the previous stage's hidden states on the others, which get this stage's output. Image
        placeholder rows take the vision encoder's embeddings (worker_svc/multimodal.py)."""
        stage = self.stage
        if self.mm is not None and stage.is_first and self.mm.needed(seqs):
            embeds = self.model.embed(inputs.input_ids)  # [T, hidden]
            self.mm.splice(seqs, embeds)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache.layers, embeds)
            if not stage.is_last:
                stage.send_hidden(hidden)
            return hidden
        if stage.size == 1:
            return self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache.layers)
        received = None if stage.is_first else stage.recv_hidden(
            inputs.input_ids.shape[0], self.model_config.hidden_size, self.dtype, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache.layers, received)
        if not stage.is_last:
            stage.send_hidden(hidden)
        return hidden

    def _build_inputs(self, seqs: list[ScheduledSeq]):
        """A decode-only step into the fixed buffers (no per-step allocation); others in full."""
        bs = self.config.block_size
        if self._decode_buffers is not None:
            inputs = self._decode_buffers.build(seqs, bs, self.backend)
            if inputs is not None:
                return inputs
        return build_model_inputs(seqs, bs, self.backend, self.device)

    def _logit_hidden(self, hidden: torch.Tensor, inputs, logit_rows: list[int],
                      draft_rows: list[int]) -> torch.Tensor:
        """The hidden rows [N, hidden] to compute logits for. A plain decode step samples every
        row of hidden, in order: it is used as it is (the gather would only copy it)."""
        if not draft_rows and len(logit_rows) == hidden.shape[0] and logit_rows == list(range(len(logit_rows))):
            return hidden
        index = inputs.logits_indices[torch.tensor(logit_rows, dtype=torch.long, device=self.device)]
        if draft_rows:
            index = torch.cat([index, torch.tensor(draft_rows, dtype=torch.long, device=self.device)])
        return hidden[index]

    def _grammar(self, sampling: SamplingParams) -> GrammarState | None:
        """Starts compiling a new request's grammar now, so it overlaps the forward pass."""
        if self.grammars is None or sampling.structured_outputs is None:
            return None
        return self.grammars.state(sampling.structured_outputs)

    def _sync_clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _load_vision(self) -> MultiModalEmbedder | None:
        """A vision-language checkpoint's encoder (replicated on every rank: it runs once per image)."""
        if self.model_config.multimodal is None:
            return None
        from worker_svc.models.llava_vision import LlavaVision

        vision = LlavaVision.load(self.config.model, self.dtype, self.device)
        log.info("vision_encoder_loaded", architecture=self.model_config.multimodal,
                 encoder_cache_size=self.config.encoder_cache_size)
        return MultiModalEmbedder(vision, self.dtype, self.device, self.config.encoder_cache_size)

    def _pack_weights(self) -> None:
        """oneDNN-packed linears where this CPU runs oneDNN's kernels for the model's dtype;
        plain `nn.Linear` (aten's matmul, slower but exact) elsewhere, said once in the log."""
        if can_pack(self.device, self.dtype):
            pack_linear_weights(self.model)
            # One oneDNN primitive per GEMM shape, cached: bucketed rows keep the worker's RSS flat.
            bucket_linear_rows(self.model, PackedLinear)
        else:
            log.warning("linear_packing_unsupported", dtype=str(self.dtype).removeprefix("torch."),
                        cpu_capability=torch.backends.cpu.get_cpu_capability(),
                        fallback="nn.Linear")

    def _warm_row_buckets(self) -> None:
        """Once: every row bucket's oneDNN primitive, for the limits the scheduler sent (Init)."""
        if self._buckets_warm or not self.config.warmup_row_buckets:
            return
        self._buckets_warm = True
        start = time.perf_counter()
        max_rows = min(self.max_num_batched_tokens, self.max_model_len)
        count = warm_row_buckets(self.model, self.dtype, max_rows, min(self.max_num_seqs, max_rows))
        if count:
            release_free_heap()  # the warm-up's freed activations, else kept by glibc as RSS
            log.info("row_buckets_warmed", gemms=count, max_rows=max_rows, max_logit_rows=min(self.max_num_seqs, max_rows),
                     seconds=round(time.perf_counter() - start, 3))

    def _install_fused_decode(self) -> None:
        """Pure-decode steps as one compiled op where the model and this worker qualify
        (worker_svc/models/fused_decode.py); the module loop runs every other step."""
        setting = FusedSetting(self.device, self.dtype, self.cache_dtype, self.backend.name,
                               self.tp.size, self.lora is not None, self.config.batch_invariant)
        fused, why = fused_decode_for(self.model, setting)
        if fused is not None:
            self.model.fused_decode = fused
        log.info("fused_decode", enabled=fused is not None, reason=why)
        if any(getattr(m.weight_q, "bits", 0) == 8 for m in self.model.modules() if isinstance(m, QuantLinear)):
            kernel, why = int8_dot_status()  # 8-bit codes: int8 dot products, or the fp32 fallback
            log.info("quant_int8_dot", kernel=kernel, reason=why)

    def _make_batch_invariant(self) -> None:
        """fp32 results here do not depend on the batch shape already (oneDNN's fp32 kernels sum
        each row alike); bf16 ones do, so bf16 linears move to the batch-invariant op."""
        if self.device.type != "cpu" or self.tp.size != 1:
            raise ValueError("--batch-invariant is implemented for a single CPU worker")
        if self.quantization is not None:  # the quantized op picks its path by row count
            raise ValueError("--batch-invariant needs float weights: add --quantization none for a GGUF")
        if self.dtype == torch.bfloat16:
            count = make_linears_batch_invariant(self.model)
            log.info("batch_invariant_linears", count=count, amx=batch_invariant_uses_amx())
        elif self.dtype == torch.float32:
            self._pack_weights()
        else:
            raise ValueError(f"--batch-invariant supports float32 and bfloat16, not {self.dtype}")

    def _resolve_quantization(self) -> str | None:
        """The load's `quantization` (worker_svc/model_loader/loader.py), or a clear refusal at start:
        the quantized layers run on CPU, one rank, without LoRA (docs/quantization.md)."""
        wanted, config = self.config.quantization, self.config
        gguf = is_gguf_file(config.model)
        if wanted in ("int8", "int4"):
            where = ("a CUDA worker" if self.device.type != "cpu" else
                     "tensor parallelism" if config.tensor_parallel_size > 1 else
                     "pipeline parallelism" if config.pipeline_parallel_size > 1 else
                     "LoRA (--enable-lora)" if config.enable_lora else
                     "a GGUF file (its quantized weights are served as stored: --quantization auto)" if gguf
                     else None)
            if where is not None:
                raise ValueError(f"--quantization {wanted} is not supported with {where}; quantized "
                                 "linears run on a single CPU worker without LoRA")
            if self.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"--quantization {wanted} needs --dtype float32 or bfloat16 activations")
            return wanted
        if wanted == "none" or not gguf:
            return None
        if self.device.type != "cpu" or config.tensor_parallel_size > 1 or config.enable_lora \
                or config.pipeline_parallel_size > 1 \
                or self.dtype not in (torch.float32, torch.bfloat16):
            log.warning("gguf_dequantized", reason="quantized linears run on a single CPU worker without "
                        "LoRA, fp32/bf16 activations", device=self.device.type,
                        tensor_parallel_size=config.tensor_parallel_size, lora=config.enable_lora)
            return None
        return "gguf"

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if not 0 < wanted <= limit:
            raise ValueError(f"max_model_len {wanted} must be in [1, {limit}] (the model's limit)")
        return wanted

    @torch.inference_mode()
    def _profile_peak_memory(self, shape: CacheShape) -> int:
        """Peak bytes allocated (weights included) by a forward of max_num_batched_tokens dummy
        tokens and a full batch of sampled logits, on a one-block scratch cache."""
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch = KVCache(shape, 1, self.device)
        params = SamplingParams(max_tokens=None)
        state = CachedRequestState(RequestId("profile"), [0] * num_tokens, num_tokens,
                                   [0] * math.ceil(num_tokens / shape.block_size), 0, params)
        inputs = build_model_inputs([ScheduledSeq(state, num_tokens)], shape.block_size,
                                    self.backend, self.device)
        received = None if self.stage.is_first else torch.zeros(
            num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, scratch.layers, received)
        num_rows = min(PROFILE_SAMPLING_ROWS, num_tokens)
        logits = None
        if self.stage.is_last:  # only the last pipeline stage holds the LM head
            logits = self.model.compute_logits(hidden[:num_rows]).float()
            self.sampler(logits, [state.sampling_row()] * num_rows)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden, logits, inputs
        torch.cuda.empty_cache()
        return peak
