"""The decode fast path's fixed buffers build exactly the inputs build_model_inputs builds."""

from __future__ import annotations

import pytest
import torch

from kernels import get_backend
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from worker_svc.input_batch import CachedRequestState, DecodeInputBuffers, ScheduledSeq, build_model_inputs

BS = 4


def decode_seq(name: str, num_tokens: int, blocks: list[int]) -> ScheduledSeq:
    tokens = list(range(100, 100 + num_tokens))
    state = CachedRequestState(RequestId(name), tokens, 3, blocks, num_tokens - 1, SamplingParams())
    return ScheduledSeq(state, 1)


def assert_same(fast, general) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert getattr(fast, name).dtype == getattr(general, name).dtype, name
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        a, b = getattr(fast.attn, name), getattr(general.attn, name)
        assert a.dtype == b.dtype and a.is_contiguous(), name
        assert torch.equal(a, b), name
    assert (fast.attn.max_query_len, fast.attn.max_seq_len) == (general.attn.max_query_len, general.attn.max_seq_len)
    assert fast.last_rows.tolist() == general.last_rows.tolist()


def test_decode_steps_build_what_the_general_path_builds() -> None:
    backend, cpu = get_backend("torch"), torch.device("cpu")
    buffers = DecodeInputBuffers(max_num_seqs=8, max_blocks_per_seq=6, device=cpu)
    wide = [decode_seq("a", 9, [7, 2, 5]), decode_seq("b", 4, [3]), decode_seq("c", 13, [1, 4, 6, 8])]
    assert_same(buffers.build(wide, BS, backend), build_model_inputs(wide, BS, backend, cpu))
    # A narrower step after a wider one: no stale table entries, the same [S, max_blocks] shape.
    narrow = [decode_seq("d", 5, [9, 11])]
    fast = buffers.build(narrow, BS, backend)
    assert_same(fast, build_model_inputs(narrow, BS, backend, cpu))
    assert fast.attn.block_tables.tolist() == [[9, 11]]
    assert fast.attn.slot_mapping.tolist() == [11 * BS + 0]  # position 4: block 1, offset 0


@pytest.mark.parametrize("case", ["prefill", "too_many_seqs", "table_too_long", "empty"])
def test_other_steps_are_left_to_the_general_path(case) -> None:
    buffers = DecodeInputBuffers(max_num_seqs=2, max_blocks_per_seq=2, device=torch.device("cpu"))
    seqs = {"prefill": [ScheduledSeq(CachedRequestState(RequestId("p"), [1, 2, 3], 3, [0], 0,
                                                        SamplingParams()), 3)],
            "too_many_seqs": [decode_seq(str(i), 2, [i]) for i in range(3)],
            "table_too_long": [decode_seq("t", 10, [0, 1, 2])],
            "empty": []}[case]
    assert buffers.build(seqs, BS, get_backend("torch")) is None
