"""The segmented LoRA matmul: every row gets exactly its own adapter's delta, base rows none,
whatever the mix of group sizes (one long prefill next to single decode tokens)."""

import numpy as np
import pytest
import torch

from worker_svc.lora.layers import build_lora_batch, segmented_lora_delta


@pytest.mark.parametrize("token_slots", [
    [-1, -1, -1],
    [0, 0, 0, 0],
    [2, -1, 0, 2, 1, -1, 0, 0, 3],
    [1] * 37 + [0, -1, 2, 3, -1],  # one long prefill and three decodes: chunks of the mean size
    [3, -1] * 10,
    [1, 3, 1, 3],  # by slot with slot 2 unused in between
])
def test_each_row_gets_its_own_adapter_delta(token_slots):
    gen = torch.Generator().manual_seed(0)
    slots, t, d_in, width, d_out = 4, len(token_slots), 12, 6, 10
    x = torch.randn(t, d_in, generator=gen, dtype=torch.float64)
    a = torch.randn(slots, d_in, width, generator=gen, dtype=torch.float64)
    b = torch.randn(slots, width, d_out, generator=gen, dtype=torch.float64)
    batch = build_lora_batch(np.array(token_slots), frozenset({"qkv"}), torch.device("cpu"))
    expected = torch.zeros(t, d_out, dtype=torch.float64)
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            expected[row] = x[row] @ a[slot] @ b[slot]
    if batch is None:
        assert all(s < 0 for s in token_slots)
        return
    got = torch.zeros(t, d_out, dtype=torch.float64).index_add_(
        0, batch.rows, segmented_lora_delta(x, a, b, batch))
    torch.testing.assert_close(got, expected)
    real_rows = sum(s >= 0 for s in token_slots)
    assert batch.gather_rows.numel() <= 2 * real_rows + batch.gather_rows.shape[0]  # bounded padding


def test_equal_groups_use_the_slot_matrices_in_place_and_a_long_prefill_is_chunked():
    decode = build_lora_batch(np.array([0, 1, 2, 3] * 4), frozenset(), torch.device("cpu"))
    assert decode.chunk_slots is None and tuple(decode.gather_rows.shape) == (4, 4)
    assert decode.valid is None  # nothing padded: the deltas are used as they come
    prefill = build_lora_batch(np.array([0] * 40 + [1, 2, 3]), frozenset(), torch.device("cpu"))
    assert prefill.chunk_slots is not None and prefill.gather_rows.numel() < 2 * 43 + 4


class _Owner:
    batch = None


@pytest.mark.parametrize("token_slots", [
    [-1, -1, 0, 0, 1, 1, 2, 2],  # grouped, equal, consecutive slots: the two-op block path
    [0, 0, 0, 1, 1, 1],
    [-1, 0, 0, 2, 2],  # a slot missing in between: the general path
    [0, 1, 0, 1, -1],  # not grouped (the runner groups them, but any order must work)
    [-1] * 3 + [0] * 40 + [2] * 35,  # long groups (prefill): one matmul per adapter
])
def test_lora_linear_adds_each_rows_delta_on_top_of_the_base(token_slots):
    from worker_svc.lora.layers import LoRALinear

    gen = torch.Generator().manual_seed(1)
    base = torch.nn.Linear(8, 6, dtype=torch.float64)
    owner = _Owner()
    # three sub-projections (q, k, v) of widths 3, 1, 2, rank 2: A [8, 6], B [2, 6]
    layer = LoRALinear(base, "qkv", 0, 8, (3, 1, 2), 2, 3, owner, torch.float64, torch.device("cpu"))
    layer.lora_a.copy_(torch.randn(3, 8, 6, generator=gen, dtype=torch.float64))
    layer.lora_b.copy_(torch.randn(3, 2, 6, generator=gen, dtype=torch.float64))
    x = torch.randn(len(token_slots), 8, generator=gen, dtype=torch.float64)
    owner.batch = build_lora_batch(np.array(token_slots), frozenset({"qkv"}), torch.device("cpu"))
    expected = base(x).detach().clone()
    for row, slot in enumerate(token_slots):
        for sub, (c0, c1) in enumerate(((0, 3), (3, 4), (4, 6))):  # each sub: its A columns, its outputs
            if slot >= 0:
                a, b = layer.lora_a[slot][:, 2 * sub:2 * sub + 2], layer.lora_b[slot][:, c0:c1]
                expected[row, c0:c1] += x[row] @ a @ b
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, expected)
    assert (owner.batch.block is not None) == (token_slots in ([-1, -1, 0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1]))
    assert (owner.batch.segments is not None) == (len(token_slots) == 78)
