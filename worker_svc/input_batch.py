"""Resident request state on the worker, and the flat input tensors of one step built from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.contract.ids import RequestId
from pagoda.contract.lora import LoRARequest
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import BeamUpdate
from worker_svc.models.common import AttentionMetadata
from worker_svc.sampler import SamplingRow
from worker_svc.structured_output import GrammarState


@dataclass(slots=True)
class CachedRequestState:
    """One resident sequence. Invariant: num_computed_tokens <= len(token_ids), and the cache holds
    K/V for positions [0, num_computed_tokens) in the blocks of block_ids."""

    request_id: RequestId
    token_ids: list[int]  # prompt + outputs so far (the worker appends its own samples)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    seq_index: int = 0
    grammar: GrammarState | None = None  # structured outputs (the sampling rank only)
    lora: LoRARequest | None = None  # its adapter; None: the base model
    pool_sum: torch.Tensor | None = None  # mean pooling: fp32 sum of the positions computed so far
    mm_inputs: tuple = ()  # the prompt's images (pagoda.contract.multimodal.MultiModalInput)

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(self.sampling, self.token_ids, self.num_prompt_tokens, self.seq_index,
                           self.grammar)

    def fork(self, child_id: RequestId, seq_index: int) -> CachedRequestState:
        """A child sharing every block (the scheduler ref-counts them); lists are copied."""
        return CachedRequestState(child_id, list(self.token_ids), self.num_prompt_tokens,
                                  list(self.block_ids), self.num_computed_tokens, self.sampling,
                                  seq_index, self.grammar.fork() if self.grammar else None, self.lora)


def apply_beam_updates(requests: dict[RequestId, CachedRequestState], updates: list[BeamUpdate]) -> None:
    """Beam search: each beam becomes a copy of its parent (all read before any is replaced) whose
    last, sampled but not yet computed, token is the one the scheduler chose."""
    parents = {u.parent_id: requests[u.parent_id] for u in updates}
    for update in updates:
        parent = parents[update.parent_id]
        current = requests.get(update.request_id)
        beam = parent.fork(update.request_id, current.seq_index if current is not None else parent.seq_index)
        beam.token_ids[-1] = update.token_id
        requests[update.request_id] = beam


@dataclass(slots=True)
class ScheduledSeq:
    state: CachedRequestState
    num_tokens: int  # computed this step, starting at state.num_computed_tokens


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the last query row of each sequence
    last_rows: np.ndarray  # the same, on the host


def build_model_inputs(seqs: list[ScheduledSeq], block_size: int, backend: object,
                       device: torch.device) -> ModelInputs:
    """Flatten the scheduled sequences back to back (sequence i owns rows [qsl[i], qsl[i+1]))."""
    query_lens = np.array([s.num_tokens for s in seqs], dtype=np.int64)  # [S]
    starts = np.array([s.state.num_computed_tokens for s in seqs], dtype=np.int64)  # [S]
    seq_lens = starts + query_lens  # [S]: context including this step's tokens
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    seq_of_token = np.repeat(np.arange(len(seqs)), query_lens)  # [T]
    positions = np.arange(num_tokens) - query_start_loc[seq_of_token] + starts[seq_of_token]  # [T]
    input_ids = np.fromiter(
        (t for s in seqs for t in s.state.token_ids[s.state.num_computed_tokens:
                                                    s.state.num_computed_tokens + s.num_tokens]),
        dtype=np.int64, count=num_tokens)

    max_blocks = max(1, max(len(s.state.block_ids) for s in seqs))
    block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)  # entries past a table's end: 0
    for i, s in enumerate(seqs):
        block_tables[i, : len(s.state.block_ids)] = s.state.block_ids
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    attn = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64),
        block_tables=to_device(block_tables, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        query_start_loc=to_device(query_start_loc, torch.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        backend=backend,
    )
    last_rows = query_start_loc[1:] - 1
    return ModelInputs(input_ids=to_device(input_ids, torch.int64),
                       positions=to_device(positions, torch.int64), attn=attn,
                       logits_indices=to_device(last_rows, torch.int64), last_rows=last_rows)


class DecodeInputBuffers:
    """`build_model_inputs` for a decode-only step (one token per sequence), written into buffers
    allocated once, as vLLM's InputBatch does: no numpy gather/repeat and no new tensors per step
    (measured at batch 1: benchmarks/plan_overhead.py --breakdown). The tensors it returns are
    views of those buffers, valid until the next `build`; the runner uses them within the step.

    Invariant: what it builds equals build_model_inputs' result for the same sequences (a test
    compares them), so the forward sees exactly the same inputs."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_num_seqs, self.max_blocks = max_num_seqs, max_blocks_per_seq
        self.device = device
        # int64: [0:S) input ids, [S:2S) positions, [2S:3S) slots; int32: seq lens, query starts,
        # then the block tables flat (a contiguous [S, max_blocks] view for any S and width).
        self._i64 = np.zeros(3 * max_num_seqs, dtype=np.int64)
        self._i32 = np.zeros(2 * max_num_seqs + 1 + max_num_seqs * max_blocks_per_seq, dtype=np.int32)
        self._rows = np.arange(max_num_seqs + 1, dtype=np.int64)  # query starts / last rows
        self._i32[max_num_seqs:2 * max_num_seqs + 1] = self._rows  # query_start_loc: 0..S

    def build(self, seqs: list[ScheduledSeq], block_size: int, backend: object) -> ModelInputs | None:
        """None when this is not a decode-only step that fits (the caller builds the general way)."""
        num_seqs = len(seqs)
        if not 0 < num_seqs <= self.max_num_seqs:
            return None
        states = [s.state for s in seqs]
        positions = [state.num_computed_tokens for state in states]
        tables = [state.block_ids for state in states]
        max_blocks = max(1, max(map(len, tables)))
        if max_blocks > self.max_blocks or any(s.num_tokens != 1 for s in seqs) or any(
                p != len(state.token_ids) - 1 for p, state in zip(positions, states, strict=True)):
            return None
        # Whole slices from Python lists: one conversion each, not one numpy store per element.
        i64, i32, cap = self._i64, self._i32, self.max_num_seqs
        i64[:num_seqs] = [state.token_ids[-1] for state in states]
        i64[cap:cap + num_seqs] = positions
        i64[2 * cap:2 * cap + num_seqs] = [table[p // block_size] * block_size + p % block_size
                                           for table, p in zip(tables, positions, strict=True)]
        i32[:num_seqs] = positions
        i32[:num_seqs] += 1
        tables_2d = i32[2 * cap + 1:2 * cap + 1 + num_seqs * max_blocks].reshape(num_seqs, max_blocks)
        tables_2d.fill(0)  # entries past a table's end: 0, as build_model_inputs pads
        for row, table in zip(tables_2d, tables, strict=True):  # row by row: measured faster than one
            row[:len(table)] = table  # flat padded list from 128 sequences up
        seq_lens = i32[:num_seqs]
        attn = AttentionMetadata(
            slot_mapping=self._tensor(i64[2 * cap:2 * cap + num_seqs]),
            block_tables=self._tensor(tables_2d), seq_lens=self._tensor(seq_lens),
            query_start_loc=self._tensor(i32[cap:cap + num_seqs + 1]),
            max_query_len=1, max_seq_len=max(positions) + 1, backend=backend)
        rows = self._rows[:num_seqs]
        return ModelInputs(input_ids=self._tensor(i64[:num_seqs]), positions=self._tensor(i64[cap:cap + num_seqs]),
                           attn=attn, logits_indices=self._tensor(rows), last_rows=rows)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)  # shares the buffer: no copy on CPU
        return tensor if self.device.type == "cpu" else tensor.to(self.device)
