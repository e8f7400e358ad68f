"""The offline API, shaped like vLLM's: `LLM(model=DIR).generate(prompts, sampling_params)`, and
`LLM(model=DIR).embed(texts)` for embeddings (the services' pooling path: a prefill-only request
whose final hidden states the worker pools, `pooling_type` last | mean, L2-normalised unless
`normalize_embeddings=False`).

One process, synchronous loop: scheduler.schedule -> runner.execute -> scheduler.update, until
every request of the batch has finished. Same scheduler core and model runner as the services.
With tensor_parallel_size=N this process is rank 0 and spawns N-1 follower processes; `close()`
(or leaving a `with LLM(...)` block, `del llm` once nothing else refers to it, or interpreter
exit) stops them and leaves the group, so a new `LLM` can form its own.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.contract.ids import RequestId
from pagoda.contract.lora import LoRARequest, read_adapter_config
from pagoda.contract.params import POOLING, SamplingParams, check_vocab, with_bad_words_tokenized
from pagoda.contract.step import TokenLogprobs
from pagoda.contract.structured import check_grammar
from pagoda.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from scheduler_svc.core.config import SchedulerConfig, SpeculativeConfig, check_preemption_mode
from scheduler_svc.core.outputs import SequenceDelta
from scheduler_svc.core.request import EngineRequest
from scheduler_svc.core.scheduler import Scheduler
from worker_svc.config import WorkerConfig
from worker_svc.parallel.tp_worker import create_runner

Prompt = str | dict[str, Any]  # a string, or {"prompt_token_ids": [...]}


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" / "length"
    logprobs: list[TokenLogprobs] | None = None  # one per token when asked for; raw-model logprobs
    cumulative_logprob: float | None = None  # beam search: the beam's summed logprobs


@dataclass(slots=True)
class RequestMetrics:
    """When the request arrived, got its first token and finished (time.time(), vLLM's names):
    per-request TTFT and decode speed for offline runs."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it); each TokenLogprobs holds the prompt token's raw-model logprob, its rank and the
    # top k. None when not asked.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # the model's hidden size


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One input's embedding, as vLLM's `LLM.embed` returns it (`.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class LLM:
    def __init__(self, model: str, dtype: str = "auto", block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 num_gpu_blocks_override: int | None = None, enable_prefix_caching: bool = True,
                 seed: int = 0, kv_cache_memory_bytes: int | None = None,
                 attention_backend: str = "auto", tensor_parallel_size: int = 1, device: str = "auto",
                 pipeline_parallel_size: int = 1, distributed_executor_backend: str = "mp",
                 long_prefill_token_threshold: int = 0, max_num_encoder_input_tokens: int = 0,
                 speculative_config: dict | str | None = None,
                 pinned_prompts: Sequence[str | list[int]] | None = None, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 kv_cache_dtype: str = "auto", swap_space: float = 0.0,
                 preemption_mode: str | None = None, pooling_type: str = "last",
                 normalize_embeddings: bool = True, batch_invariant: bool = False,
                 kv_offloading_size: float = 0.0, kv_offload_dir: str | None = None,
                 kv_offload_dir_size: float = 8.0, kv_migrate_dir: str | None = None,
                 kv_snapshot_dir: str | None = None,
                 quantization: str | None = None, warmup_row_buckets: bool = False) -> None:
        # vLLM's spelling: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
        # "prompt_lookup_min": 2}, or {"method": "suffix", ...} (scheduler_svc/core/spec/). Checked
        # before loading.
        speculative = SpeculativeConfig.parse(speculative_config)
        # Swap preemption (scheduler_svc/core/swap.py), vLLM's names: swap_space GiB of host memory,
        # preemption_mode "recompute" / "swap" / None (by cost). Checked before loading.
        check_preemption_mode(preemption_mode, has_host_pool=swap_space > 0)
        # quantization (vLLM's name, docs/quantization.md): None/"auto" serves a GGUF's quantized
        # linears as stored, "int8"/"int4" quantize an HF directory at load, "none" dequantises.
        worker_config = WorkerConfig(
            model=model, dtype=dtype, device=device, block_size=block_size, max_model_len=max_model_len,
            num_gpu_blocks_override=num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_cache_memory_bytes, kv_cache_dtype=kv_cache_dtype,
            attention_backend=attention_backend, seed=seed, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            swap_space=swap_space, pooling_type=pooling_type, normalize_embeddings=normalize_embeddings,
            batch_invariant=batch_invariant, kv_offloading_size=kv_offloading_size,
            kv_offload_dir=kv_offload_dir, kv_offload_dir_size=kv_offload_dir_size,
            kv_migrate_dir=kv_migrate_dir, kv_snapshot_dir=kv_snapshot_dir, quantization=quantization or "auto",
            # Off offline (a batch job, and the test suite builds many LLMs): building every row
            # bucket's oneDNN primitive costs seconds at start; the worker service does it by default.
            warmup_row_buckets=warmup_row_buckets,
            speculative_model=speculative.model if speculative is not None else None)
        self.runner = create_runner(worker_config, max_num_batched_tokens=max_num_batched_tokens)
        # Runs close()'s work when the LLM is garbage-collected (vLLM's users `del` their engine);
        # it holds the runner's bound close, never `self`, so it does not keep the LLM alive.
        runner_close = getattr(self.runner, "close", None)
        self._finalizer = weakref.finalize(self, runner_close) if runner_close is not None else None
        if hasattr(self.runner, "max_num_seqs"):  # the row buckets it warms (models/row_buckets.py)
            self.runner.max_num_seqs = max_num_seqs
        try:
            self.worker_info = info = self.runner.initialize()
            scheduler_config = SchedulerConfig(  # raises if swap_space holds no block
                num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                long_prefill_token_threshold=long_prefill_token_threshold,
                max_num_encoder_input_tokens=max_num_encoder_input_tokens,
                enable_prefix_caching=enable_prefix_caching, eos_token_ids=info.eos_token_ids,
                speculative=speculative, max_loras=info.max_loras, num_cpu_blocks=info.num_cpu_blocks,
                preemption_mode=preemption_mode, sliding_window=info.sliding_window,
                num_offload_blocks=info.num_offload_blocks if enable_prefix_caching else 0,
                num_disk_blocks=info.num_disk_blocks if enable_prefix_caching else 0,
                kv_migration=info.kv_migration, kv_snapshots=bool(info.kv_snapshot_dir))
        except BaseException:
            self.close()
            raise
        self.scheduler = Scheduler(scheduler_config)
        self.scheduler.restore_disk_tier(info.disk_blocks)  # kv_offload_dir's files, from earlier runs too
        self.model_dir = model
        self._tokenizer: Any = None
        self._images: Any = None  # pagoda.contract.image_inputs.ImageProcessor, on the first image
        self._request_counter = itertools.count()
        if pinned_prompts:  # prefilled now, kept in the prefix cache for this LLM's lifetime
            for prompt in pinned_prompts:
                self.scheduler.pin_prompt(self._tokenize(prompt)[1] if isinstance(prompt, str) else prompt)
            while self.scheduler.pins_pending:
                self.scheduler.update(self.runner.execute(self.scheduler.schedule()))

    def close(self) -> None:
        """Stop the tensor-parallel follower processes (nothing to do at TP=1). Idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # a finalize object runs its function at most once

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from pagoda.runtime.model_files import load_tokenizer  # slow: only when text is involved

            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def stats(self) -> Any:
        """The scheduler's counters (prefix hits/queries in tokens, preemptions, ...)."""
        return self.scheduler.stats()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; one RequestOutput per prompt, in input order. `lora_request`:
        one adapter for every prompt, or one per prompt (None: the base model), as in vLLM."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = _per_prompt_params(sampling_params, len(prompts))
        loras = _per_prompt_loras(lora_request, len(prompts))
        outputs: dict[RequestId, RequestOutput] = {}
        try:
            for prompt, sampling, lora in zip(prompts, params, loras, strict=True):
                request_id = RequestId(str(next(self._request_counter)))
                text, token_ids = self._tokenize(prompt)
                token_ids, mm_inputs = self._with_images(prompt, token_ids)
                sampling = self._resolve_params(sampling)
                if lora is not None:  # a missing or too-large adapter fails here, not in a step
                    read_adapter_config(lora.lora_path, self.worker_info.max_lora_rank or None)
                self.scheduler.add_request(EngineRequest(request_id, tuple(token_ids), sampling, lora=lora,
                                                         mm_inputs=mm_inputs))
                outputs[request_id] = RequestOutput(
                    request_id, text, list(token_ids),
                    [CompletionOutput(i, logprobs=[] if sampling.logprobs is not None else None)
                     for i in range(sampling.n)], metrics=RequestMetrics(time.time()),
                    prompt_logprobs=[None] if sampling.prompt_logprobs is not None else None)
        except Exception:
            for request_id in outputs:  # one bad prompt rejects the batch: leave nothing queued
                self.scheduler.abort(request_id)
            raise
        try:
            self._run_to_completion(outputs, use_tqdm)
        except BaseException as error:  # incl. KeyboardInterrupt: the next generate starts clean
            self.scheduler.fail_all(f"offline generate failed: {error!r}")
            self.runner.reset()
            disk = getattr(self.runner, "disk", None)  # its files are still there: list them again
            if disk is not None:
                self.scheduler.restore_disk_tier(disk.listing())
            raise
        for output in outputs.values():
            for completion in output.outputs:
                completion.text = self._detokenize(completion.token_ids)
        return list(outputs.values())

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of OpenAI-shaped messages) or several, each
        rendered with the model's chat template; image parts (data URLs, PIL images) go to a
        vision-language model as `multi_modal_data` (chat_inputs.py)."""
        from pagoda.entrypoints.chat_inputs import chat_prompt

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[Prompt] = []
        for conversation in conversations:
            rendered, images = chat_prompt(conversation)
            ids = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                     tokenize=False)
            prompt: dict[str, Any] = {"prompt_token_ids": self.tokenizer(ids, add_special_tokens=False)["input_ids"]}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (text, or {"prompt_token_ids": [...]}), in input order: the same
        engine request /v1/embeddings and the gRPC Embed send (SamplingParams POOLING), so the
        same model and pooling give the same vector."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if any(not self._tokenize(prompt)[1] for prompt in prompts):
            raise ValueError("an input must not be empty")
        outputs = self.generate(prompts, POOLING, use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.embedding))
                for out in outputs]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: per prompt, `beam_width` finished beams, best first."""
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)
        return [BeamSearchOutput([
            BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.cumulative_logprob or 0.0,
                               c.text, c.finish_reason)
            for c in out.outputs]) for out in outputs]

    def _run_to_completion(self, outputs: dict[RequestId, RequestOutput], use_tqdm: bool) -> None:
        from tqdm.auto import tqdm

        unfinished = {rid: len(out.outputs) for rid, out in outputs.items()}  # sequences left
        with tqdm(total=len(outputs), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.scheduler.has_unfinished_requests():
                plan = self.scheduler.schedule()
                if plan is None:
                    raise RuntimeError("the scheduler has unfinished requests but planned no step")
                result = self.runner.execute(plan)
                for delta in self.scheduler.update(result):
                    if delta.request_id not in outputs:  # a pinned prompt re-run after a failure
                        continue
                    if _apply_delta(outputs, delta):
                        unfinished[delta.request_id] -= 1
                        if unfinished[delta.request_id] == 0:
                            outputs[delta.request_id].finished = True
                            bar.update(1)

    def _resolve_params(self, sampling: SamplingParams) -> SamplingParams:
        """bad_words text -> token ids; token ids checked against the vocabulary."""
        if sampling.bad_words:
            def encode(text: str) -> list[int]:
                return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            sampling = with_bad_words_tokenized(sampling, encode)
        check_vocab(sampling, self.worker_info.vocab_size)
        if sampling.structured_outputs is not None:
            check_grammar(sampling.structured_outputs)  # a bad schema raises here, not in the worker
        return sampling

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
            return prompt["prompt"], list(self.tokenizer(prompt["prompt"])["input_ids"])
        raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt)}")

    def _with_images(self, prompt: Prompt, token_ids: list[int]) -> tuple[list[int], tuple]:
        """vLLM's `multi_modal_data={"image": image or [images]}` (PIL images, or encoded bytes): the
        prompt holds one placeholder token per image (LLaVA's `<image>`), expanded here."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return token_ids, ()
        from pagoda.contract.image_inputs import ImageProcessor, decode_image

        if self._images is None:
            self._images = ImageProcessor.load(self.model_dir)
            if self._images is None:
                raise ValueError(f"{self.model_dir} is not a vision-language model: no multi_modal_data")
        images = data.get("image", [])
        images = [decode_image(i) if isinstance(i, bytes) else i
                  for i in (images if isinstance(images, list | tuple) else [images])]
        return self._images.expand(token_ids, images)

    def _detokenize(self, token_ids: list[int]) -> str:
        try:
            tokenizer = self.tokenizer
        except (OSError, ValueError):  # a model directory without a tokenizer: ids only
            return ""
        return tokenizer.decode(token_ids, skip_special_tokens=True)


def _per_prompt_params(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                       num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
    return params


def _per_prompt_loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"{len(loras)} lora requests for {num_prompts} prompts")
    return loras


def _apply_delta(outputs: dict[RequestId, RequestOutput], delta: SequenceDelta) -> bool:
    """Fold one delta into its output; True when it finished its sequence."""
    output = outputs[delta.request_id]
    completion = output.outputs[delta.seq_index]
    completion.token_ids.extend(delta.new_token_ids)
    now = time.time()
    if delta.new_token_ids and output.metrics.first_token_time is None:
        output.metrics.first_token_time = now
    output.metrics.finished_time = now  # the last delta's time once every sequence has finished
    if completion.logprobs is not None:
        completion.logprobs.extend(delta.new_logprobs)
    if delta.cumulative_logprob is not None:
        completion.cumulative_logprob = delta.cumulative_logprob
    if delta.prompt_logprobs and output.prompt_logprobs is not None:
        output.prompt_logprobs.extend(delta.prompt_logprobs)
    if delta.embedding is not None:
        output.embedding = delta.embedding
    output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)
    if delta.finish_reason is None:
        return False
    completion.finish_reason = delta.finish_reason.value
    return True
