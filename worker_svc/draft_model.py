"""Draft-model speculation, the worker's half: a second, smaller model that proposes tokens.

The draft is loaded beside the target (same device, its own dtype or quantization: a GGUF's
quantized linears as stored, or `self:q4`: the target's own weights quantized to int4 at load).
Its KV lives in the block ids of the same pool as the target's: the scheduler gives every
drafting request a second block table (`ModelDraft`) and this cache is indexed by those ids, so
the draft's KV is allocated, freed, preempted and rolled back by the scheduler exactly like the
target's. Each block id thus has storage in both caches (initialize() splits the byte budget).

A step with drafts: for every drafting request, forward 1 feeds the draft the tokens its cache
lacks (usually the last one or two; the whole prompt the first time, a lazy prefill) and picks a
token; forwards 2..k feed one proposal each. The draft's logits go through the target's sampling
steps (token constraints, min_tokens, penalties; then temperature, min-p, top-k, top-p) for the
request's own parameters: greedy rows take the argmax, random rows sample from that distribution
q, which the verifier's rejection rule then needs (spec_rejection.py). A seeded request's draft
noise is seeded too, from a seed derived from its own (independent of the target's noise). All drafting requests share each forward (k small
batched forwards). The target then verifies every request's proposals in its one forward
(spec_verify.py): exact, for greedy and random rows alike, whatever the draft proposes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch

from pagoda.contract.errors import PlanError
from pagoda.contract.ids import RequestId
from pagoda.contract.step import ModelDraft
from pagoda.runtime.logging import get_logger
from pagoda.runtime.model_files import is_gguf_file
from worker_svc.input_batch import CachedRequestState, ScheduledSeq, build_model_inputs
from worker_svc.kv_cache import CacheShape, KVCache
from worker_svc.model_loader.loader import load_model
from worker_svc.models.packed_linear import PackedLinear, can_pack, pack_linear_weights
from worker_svc.models.row_buckets import bucket_linear_rows
from worker_svc.sampler import Sampler, SamplingRow, row_argmax

log = get_logger(__name__)

SELF_PREFIX = "self:"  # "self:q4": the target's own weights, quantized at load
SELF_QUANT = {"q4": "int4", "q8": "int8"}


class DraftMismatchError(ValueError):
    """The draft model cannot propose for this target (another tokenizer or vocabulary)."""


@dataclass(slots=True)
class DraftSpec:
    path: str
    quantization: str | None  # load_model's: None, "gguf", "int4", "int8"


def resolve_draft(spec: str, target: str) -> DraftSpec:
    """What to load for the speculative config's "model": a directory or GGUF, or self:q4 / self:q8."""
    if spec.startswith(SELF_PREFIX):
        kind = spec[len(SELF_PREFIX):]
        if kind not in SELF_QUANT:
            raise ValueError(f"speculative model {spec!r}: choose one of "
                             f"{', '.join(SELF_PREFIX + k for k in SELF_QUANT)}, or a model path")
        if is_gguf_file(target):
            raise ValueError(f"{spec} quantizes an HF-format target at load; {target} is a GGUF "
                             "(give a quantized GGUF draft as the model instead)")
        return DraftSpec(target, SELF_QUANT[kind])
    return DraftSpec(spec, "gguf" if is_gguf_file(spec) else None)


def check_same_tokenizer(draft: str, target: str, draft_vocab: int, target_vocab: int) -> None:
    """Refuse a draft whose token ids mean other text than the target's: its proposals would be
    verified as tokens of another vocabulary (exact still, but never accepted)."""
    if draft == target:
        return
    if draft_vocab != target_vocab:
        raise DraftMismatchError(f"the draft model {draft} has a vocabulary of {draft_vocab} tokens, the "
                                 f"target {target} {target_vocab}: a draft must share the target's tokenizer")
    from pagoda.runtime.model_files import load_tokenizer

    try:
        draft_tok, target_tok = load_tokenizer(draft), load_tokenizer(target)
    except Exception as error:  # noqa: BLE001 - a generated test model has no tokenizer files
        log.warning("draft_tokenizer_unchecked", draft=draft, target=target, reason=str(error)[:200],
                    checked="vocabulary size only")
        return
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise DraftMismatchError(f"the draft model {draft} and the target {target} have different "
                                 "tokenizers (the same token ids map to other strings)")


class DraftModel:
    def __init__(self, spec: str, target: str, target_vocab: int, dtype: torch.dtype,
                 device: torch.device, backend: object, block_size: int, pack: bool,
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0) -> None:
        what = resolve_draft(spec, target)
        if what.quantization is not None and (device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16)):
            if what.quantization != "gguf":  # as the target's --quantization int4/int8
                raise ValueError(f"speculative model {spec}: quantized linears run on a CPU worker with "
                                 "float32 or bfloat16 activations")
            what = DraftSpec(what.path, None)  # a GGUF dequantized, as the target's would be
        self.model, self.model_config = load_model(what.path, dtype, device, quantization=what.quantization)
        check_same_tokenizer(what.path, target, self.model_config.vocab_size, target_vocab)
        if pack and can_pack(device, dtype):  # the target's oneDNN-packed linears, for the same reason
            pack_linear_weights(self.model)
            bucket_linear_rows(self.model, PackedLinear)
        self.dtype, self.device, self.backend, self.block_size = dtype, device, backend, block_size
        self.tables: dict[RequestId, list[int]] = {}  # the scheduler's draft tables, as last sent
        self.sampler = Sampler(eos_token_ids, device, seed + 2)  # its own noise: not the target's
        self.cache: KVCache | None = None
        mc = self.model_config
        self.shape = CacheShape(mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, dtype)
        log.info("draft_model_loaded", model=spec, path=what.path, quantization=what.quantization,
                 layers=mc.num_layers, hidden=mc.hidden_size)

    def allocate(self, num_blocks: int) -> None:
        self.cache = None  # the old one freed first
        self.cache = KVCache(self.shape, num_blocks, self.device)

    def drop(self, request_id: RequestId) -> None:
        self.tables.pop(request_id, None)

    def check(self, drafts: list[ModelDraft], requests: dict[RequestId, CachedRequestState],
              num_blocks: int) -> None:
        """PlanError (before anything changed) for a draft entry that cannot apply."""
        for d in drafts:
            state = requests.get(d.request_id)
            if state is None:
                raise PlanError(f"model draft for {d.request_id!r}, which is not resident")
            table_len = len(self.tables.get(d.request_id, ()))
            if d.table_start > table_len or any(not 0 <= b < num_blocks for b in d.block_ids):
                raise PlanError(f"model draft table update for {d.request_id!r} does not apply: start "
                                f"{d.table_start} of {table_len}, blocks {d.block_ids}")
            end = state.num_computed_tokens + d.num_drafts  # positions the draft writes: < end
            if d.num_computed > state.num_computed_tokens or (d.table_start + len(d.block_ids)) * self.block_size < end:
                raise PlanError(f"model draft for {d.request_id!r}: positions up to {end} do not fit its "
                                f"draft table, or its draft cache is ahead of the target's")

    @torch.inference_mode()
    def propose(self, items: list[tuple[CachedRequestState, ModelDraft]]
                ) -> tuple[dict[RequestId, list[int]], dict[RequestId, torch.Tensor]]:
        """Each item's k proposals after the request's last token; and, for random rows, the
        distributions [k, V] they were drawn from (greedy rows: argmaxes, point masses)."""
        assert self.cache is not None, "allocate() before propose()"
        states: list[CachedRequestState] = []
        counts: list[int] = []
        for state, d in items:
            table = self.tables.setdefault(d.request_id, [])
            del table[d.table_start:]
            table.extend(d.block_ids)
            # A view of the request for the draft: its own cache position and table.
            states.append(CachedRequestState(d.request_id, list(state.token_ids), state.num_prompt_tokens,
                                             table, d.num_computed, _draft_params(state.sampling),
                                             state.seq_index))
            counts.append(len(state.token_ids) - d.num_computed)  # catch up, up to the last token
        wanted = {d.request_id: d.num_drafts for _, d in items}
        proposals: dict[RequestId, list[int]] = {d.request_id: [] for _, d in items}
        probs: dict[RequestId, list[torch.Tensor]] = {}
        active = list(range(len(states)))
        while active:
            seqs = [ScheduledSeq(states[i], counts[i]) for i in active]
            inputs = build_model_inputs(seqs, self.block_size, self.backend, self.device)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.cache.layers)
            logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()  # [S, V]
            tokens = self._pick(logits, [states[i] for i in active], probs)
            still = []
            for i, token in zip(active, tokens, strict=True):
                state = states[i]
                state.num_computed_tokens += counts[i]
                state.token_ids.append(token)
                counts[i] = 1
                out = proposals[state.request_id]
                out.append(token)
                if len(out) < wanted[state.request_id]:
                    still.append(i)
            active = still
        return proposals, {rid: torch.stack(rows) for rid, rows in probs.items()}

    def _pick(self, logits: torch.Tensor, states: list[CachedRequestState],
              probs: dict[RequestId, list[torch.Tensor]]) -> list[int]:
        """Greedy rows: the argmax; random rows: a sample from q, appended to `probs`."""
        rows = [SamplingRow(s.sampling, s.token_ids, s.num_prompt_tokens, s.seq_index) for s in states]
        self.sampler.adjust_logits(logits, rows)  # constraints, min_tokens, penalties: as the target's
        tokens = row_argmax(logits)
        randoms = [i for i, row in enumerate(rows) if not row.params.greedy]
        if randoms:
            index = torch.tensor(randoms, dtype=torch.long, device=logits.device)
            q = self.sampler.sampling_probs(logits[index], [rows[i] for i in randoms])  # [R, V]
            noise = self.sampler._exponential_noise([rows[i] for i in randoms], q.shape[1])
            tokens[index] = (q / noise).argmax(dim=-1)
            for j, i in enumerate(randoms):
                probs.setdefault(states[i].request_id, []).append(q[j])
        return tokens.tolist()


def _draft_params(params):
    """A seeded request's draft draws from its own seed (derived): the draft's noise must be
    independent of the target's, which the same seed would repeat position by position."""
    if params.seed is None:
        return params
    digest = hashlib.blake2b(f"draft/{params.seed}".encode(), digest_size=8).digest()
    return dataclasses.replace(params, seed=int.from_bytes(digest, "little") >> 1)
