"""Batched token sampling on device: one pass over the batch, one row per sampling sequence.

Pipeline over logits [N, V] fp32:
 1. logprobs (when a row asks): log_softmax of the *raw* model logits, before min_tokens masking,
    penalties, temperature, min-p, top-k and top-p (vLLM's default "raw_logprobs" mode).
 2. structured outputs: the grammar's token bitmask (worker_svc/structured_output.py); then token
    constraints (worker_svc/token_constraints.py): allowed_token_ids, bad_words, logit_bias.
 2b. min_tokens: while a row has fewer than min_tokens outputs, its stop tokens get -inf
    (stop_token_ids, plus the EOS ids unless ignore_eos, for which EOS does not stop anyway).
 3. penalties: repetition (HF semantics, over prompt + output tokens: a positive logit is divided,
    a negative one multiplied), then frequency and presence (OpenAI semantics, output tokens only).
 4. greedy rows take the argmax (a grammar row whose argmax its grammar refuses is masked, then
    takes the masked argmax: the same token as masking first, at the cost of a bit test).
 5. random rows: temperature, min-p, top-k, top-p (on the renormalised top-k mass), then an
    exponential race: token = argmax(p / q) with q ~ Exp(1), which draws a token from p.
    A seeded row draws q from a generator seeded with hash(seed, seq_index, output position), so
    its token depends on nothing else in the batch and is the same after preemption/recompute.
    Unseeded rows share the worker's one generator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagoda.contract.params import SamplingParams, num_beam_candidates
from pagoda.contract.step import TokenLogprobs
from worker_svc.structured_output import GrammarMasks, GrammarState, apply_grammar_masks
from worker_svc.token_constraints import apply_token_constraints

# Up to this many rows, a CPU argmax runs on the calling thread (numpy) instead of torch's
# parallel reduction. Why: a [1, 49152] row takes ~65 us on one core, and torch splits it over
# its OpenMP team, gaining nothing at this size (min 77 us with 2 threads) while one busy core
# stalls the whole call at the team's barrier (medians of 3-5 ms at batch 1 on a loaded 2-core
# machine). Same answer: numpy and torch both return the first maximum (a NaN counts as the max).
SERIAL_ARGMAX_ROWS = 8


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [N, V] logits, int64 [N] on logits' device."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[0] <= SERIAL_ARGMAX_ROWS \
            and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one sequence; token_ids is prompt + outputs so far (not copied)."""

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int
    seq_index: int = 0
    grammar: GrammarState | None = None  # structured outputs: the sequence's matcher

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # empty when none asked


def row_seed(seed: int, seq_index: int, position: int) -> int:
    """A 63-bit generator seed that depends only on (seed, seq_index, output position)."""
    digest = hashlib.blake2b(f"{seed}/{seq_index}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], device: torch.device, seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    # The runner's logits are inference tensors (made under its inference_mode); masking and
    # penalties edit them in place, which torch allows only inside inference mode too.
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits: [N, V] fp32, owned by the sampler (modified in place). One token per row."""
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        if not rows:
            return SamplerOutput(token_ids=[])
        wants_logprobs = any(r.params.logprobs is not None or r.params.beam_width for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None  # [N, V]
        masks = None
        if any(r.grammar is not None for r in rows):  # random rows now, greedy ones only if refused
            masks = GrammarMasks(rows, self.eos_token_ids, logits.shape[1])
            masks.apply(logits, [i for i in masks.index if not rows[i].params.greedy])
        self.adjust_logits(logits, rows, grammar=False)
        tokens = self._pick(logits, rows)  # [N] int64
        if masks is not None:
            self._repick_refused_greedy(logits, rows, masks, tokens)
        logprobs = self._gather_logprobs(raw_logprobs, tokens, rows) if wants_logprobs else []
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)

    # -- masking and penalties ------------------------------------------------------------------

    def _repick_refused_greedy(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                               masks: GrammarMasks, tokens: torch.Tensor) -> None:
        picked = tokens.tolist()
        refused = [i for i in masks.index if rows[i].params.greedy and masks.refused(i, picked[i])]
        if refused:
            masks.apply(logits, refused)
            index = self._long(refused)
            tokens[index] = logits[index].argmax(dim=-1)

    def adjust_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                      grammar: bool = True) -> torch.Tensor:
        """Grammar masks (unless the caller applies them), token constraints, min_tokens masking,
        then penalties, in place on logits [N, V]."""
        if grammar:
            apply_grammar_masks(logits, rows, self.eos_token_ids)
        apply_token_constraints(logits, rows)
        self._mask_stop_tokens(logits, rows)
        self._apply_penalties(logits, rows)
        return logits

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        row_idx: list[int] = []
        col_idx: list[int] = []
        vocab = logits.shape[1]
        for i, row in enumerate(rows):
            if row.num_output_tokens >= row.params.min_tokens:
                continue
            for token in row.params.stop_tokens(self.eos_token_ids):
                if token < vocab:
                    row_idx.append(i)
                    col_idx.append(token)
        if row_idx:
            logits[self._long(row_idx), self._long(col_idx)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:
            context = [rows[i].token_ids for i in rep]
            seen = self._token_counts(context, logits.shape[1]) > 0  # [R, V]
            penalty = self._float([rows[i].params.repetition_penalty for i in rep])[:, None]
            sub = logits[self._long(rep)]  # [R, V]
            penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
            logits[self._long(rep)] = torch.where(seen, penalised, sub)
        additive = [i for i, r in enumerate(rows)
                    if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
        if additive:
            outputs = [rows[i].token_ids[rows[i].num_prompt_tokens:] for i in additive]
            counts = self._token_counts(outputs, logits.shape[1])  # [R, V]
            frequency = self._float([rows[i].params.frequency_penalty for i in additive])[:, None]
            presence = self._float([rows[i].params.presence_penalty for i in additive])[:, None]
            logits[self._long(additive)] -= frequency * counts + presence * (counts > 0)

    def _token_counts(self, token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
        """[R, V] fp32 occurrence counts; padding goes to an extra column that is dropped."""
        width = max(1, max(len(tokens) for tokens in token_lists))
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for i, tokens in enumerate(token_lists):
            if tokens:
                padded[i, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
        padded = padded.to(self.device).clamp_(max=vocab)
        counts = torch.zeros(len(token_lists), vocab + 1, device=self.device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
        return counts[:, :vocab]

    # -- choosing tokens ------------------------------------------------------------------------

    def _pick(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        tokens = row_argmax(logits)  # [N]: the answer for greedy rows
        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_idx:
            return tokens
        random_rows = [rows[i] for i in random_idx]
        index = self._long(random_idx)
        probs = self.sampling_probs(logits[index], random_rows)  # [R, V]
        noise = self._exponential_noise(random_rows, probs.shape[1])  # [R, V]
        tokens[index] = (probs / noise).argmax(dim=-1)
        return tokens

    def sampling_probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution [R, V] random rows draw from: temperature, min-p, top-k, top-p."""
        temperature = self._float([r.params.temperature for r in rows])[:, None]
        probs = torch.softmax(logits / temperature, dim=-1)  # [R, V]
        min_p = [r.params.min_p for r in rows]
        if any(p > 0 for p in min_p):
            threshold = self._float(min_p)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        top_k = [r.params.top_k if r.params.top_k > 0 else probs.shape[1] for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k < probs.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
            probs = self._top_k_top_p(probs, top_k, top_p)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _top_k_top_p(self, probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Keep each row's k most likely tokens, then the smallest prefix of them holding top_p."""
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, V]
        ranks = torch.arange(probs.shape[1], device=self.device)[None, :]
        sorted_probs = sorted_probs.masked_fill(ranks >= self._long(top_k)[:, None], 0.0)
        renormalised = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        mass_before = renormalised.cumsum(dim=-1) - renormalised
        # Invariant: rank 0 always survives (mass_before == 0 < top_p), so a row never empties.
        sorted_probs = sorted_probs.masked_fill(mass_before >= self._float(top_p)[:, None], 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs)

    def _exponential_noise(self, rows: Sequence[SamplingRow], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(rows), vocab, device=self.device)
        noise.exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.params.seed is None:
                continue
            generator = torch.Generator(device=self.device)
            generator.manual_seed(row_seed(row.params.seed, row.seq_index, row.num_output_tokens))
            noise[i].exponential_(generator=generator)
        return noise

    # -- logprobs -------------------------------------------------------------------------------

    def _gather_logprobs(self, raw_logprobs: torch.Tensor, tokens: torch.Tensor,
                         rows: Sequence[SamplingRow]) -> list[TokenLogprobs | None]:
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()  # [N]
        row_k = [self._num_top(r.params) for r in rows]
        max_k = max(k or 0 for k in row_k)
        top_values: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if max_k > 0:
            values, ids = raw_logprobs.topk(min(max_k, raw_logprobs.shape[1]), dim=-1)  # [N, k], best first
            top_values, top_ids = values.tolist(), ids.tolist()
        result: list[TokenLogprobs | None] = []
        for i, k in enumerate(row_k):
            if k is None:
                result.append(None)
                continue
            top = list(zip(top_ids[i][:k], top_values[i][:k], strict=True))
            result.append(TokenLogprobs(logprob=chosen[i], top=top))
        return result

    def _num_top(self, params: SamplingParams) -> int | None:
        """Top logprobs a row returns: its `logprobs`, or a beam's candidates for the scheduler."""
        if not params.beam_width:
            return params.logprobs
        return num_beam_candidates(params.beam_width, len(params.stop_tokens(self.eos_token_ids)))

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _float(self, values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)
