"""PackedLinear (oneDNN pre-packed weights) against nn.Linear, and the module swap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker_svc.models.packed_linear import PackedLinear, can_pack, pack_linear_weights

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 7, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_nn_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(160, 96, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(160, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    expected = linear(x)
    got = PackedLinear(linear)(x)
    assert got.shape == expected.shape == (rows, 160) and got.dtype == torch.float32
    # only the summation order differs: |error| ~ ulp(|x|·|w| summed over 96 terms)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_within_bf16_rounding_of_fp32():
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(9, 128, generator=gen).to(torch.bfloat16)
    got = PackedLinear(linear)(x)
    exact = x.float() @ linear.weight.float().t()
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), exact, rtol=2e-2, atol=2e-2)


def test_pack_swaps_every_linear_and_keeps_a_tied_embedding_readable():
    embed = nn.Embedding(50, 32)
    head = nn.Linear(32, 50, bias=False)
    head.weight = embed.weight  # tied, as in Qwen2 / SmolLM2
    model = nn.ModuleDict({"embed": embed, "block": nn.Sequential(nn.Linear(32, 32), nn.ReLU()), "head": head})
    ids = torch.tensor([3, 7, 49])
    hidden = model["embed"](ids)
    expected = model["head"](model["block"](hidden))
    assert pack_linear_weights(model) == 2
    assert isinstance(model["head"], PackedLinear) and isinstance(model["block"][0], PackedLinear)
    assert torch.equal(model["embed"](ids), hidden)  # the embedding table is untouched
    assert torch.allclose(model["head"](model["block"](hidden)), expected, rtol=1e-5, atol=1e-5)


def test_reduced_precision_packs_only_where_onednn_runs_it(monkeypatch):
    """A CPU without avx512_fp16 / avx_ne_convert (AMD EPYC Zen 4) cannot pack fp16: oneDNN's
    probe says so and `can_pack` follows it, whatever this machine has."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    cpu = torch.device("cpu")
    assert can_pack(cpu, torch.float32)
    assert not can_pack(cpu, torch.float16) and not can_pack(cpu, torch.bfloat16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: True)
    assert can_pack(cpu, torch.float16)
