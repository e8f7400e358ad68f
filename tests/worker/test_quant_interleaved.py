"""8-bit codes with rows interleaved by 16 (QuantizedWeight.interleaved, made at load by
quant_linear.interleave_rows where the int16 AVX512-VNNI kernel is the default): the same bytes,
read back exactly by every Python reader (rows, dequantize, the embedding gather of a tied head);
the op's interleaved kernel equals dequantise-then-matmul on the int16-rounded activations up to fp32
summation, and every other call (int8 or fp32 activations, prefill rows, a CPU without the
kernel) widens rows from the interleaved places and gives the row-major weight's own result."""

from __future__ import annotations

import pytest
import torch

from tests.worker.int8_dot import activation_bits, assert_within_summation_bound, quantized_activations
from worker_svc.model_loader.quant_format import QuantizedWeight, quantize
from worker_svc.models.quant_linear import (
    QuantLinear,
    _ops,
    interleave_rows,
    interleaving_default,
    quant_matmul,
)

OPS = _ops()


def _weight(n: int, k: int, half: bool, seed: int) -> QuantizedWeight:
    w = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, "int8")
    return QuantizedWeight(w.qweight, w.scales.half(), None, 8, 32) if half else w


SHAPES = [(16, 32), (48, 96), (32, 544), (64, 1536)]  # one tile / K % 64 == 32 / 17 blocks / the MLP's K


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_same_bytes_read_back_exactly(shape, half):
    weight = _weight(*shape, half, seed=1)
    inter = weight.interleave_rows()
    n, k = shape
    assert inter.interleaved and inter.shape == weight.shape and inter.nbytes == weight.nbytes
    assert inter.qweight.shape == (n // 16, k // 2, 32) and inter.scales.shape == (n // 16, k // 32, 16)
    assert torch.equal(inter.qweight[0, 0, :2], weight.qweight[0, :2])  # row 0's first pair...
    assert torch.equal(inter.qweight[0, 0, 2:4], weight.qweight[1, :2])  # ...then row 1's
    back = inter.row_major()
    assert torch.equal(back.qweight, weight.qweight) and torch.equal(back.scales, weight.scales)
    assert torch.equal(inter.dequantize(), weight.dequantize())
    ids = torch.tensor([0, n - 1, 17 % n, 3, 3])
    assert torch.equal(inter.rows(ids).dequantize(), weight.rows(ids).dequantize())
    assert torch.equal(inter.narrow(0, n // 2, n // 4).dequantize(), weight.narrow(0, n // 2, n // 4).dequantize())


def test_only_8_bit_codes_in_groups_of_32_without_mins_and_whole_tiles_interleave():
    for weight in (quantize(torch.randn(20, 64), "int8"),  # 20 rows: not a whole tile
                   quantize(torch.randn(32, 64), "int4"),
                   quantize(torch.randn(32, 128), "int8", group=64)):
        with pytest.raises(ValueError, match="interleave"):
            weight.interleave_rows()


def _case(shape, half, m, dtype):
    weight = _weight(*shape, half, seed=m)
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, shape[1], generator=gen).to(dtype)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    return weight, weight.interleave_rows(), x, torch.randn(shape[0], generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 33])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_dequantise_then_matmul_on_the_activations_it_multiplies(shape, half, m, dtype):
    weight, inter, x, bias = _case(shape, half, m, dtype)
    out = quant_matmul(x, inter, bias)
    assert out.dtype == dtype and out.shape == (m, shape[0])
    bits = activation_bits(inter, m)
    # the int32 sums' fp32 conversion (up to 32 products a lane) rounds to 24 bits: inside the bound
    assert_within_summation_bound(out, x.double() if bits == 32 else quantized_activations(x, bits), weight, bias)


@pytest.mark.skipif(OPS is None or not hasattr(OPS, "quant_int8_dot") or OPS.quant_int8_dot()[1] != 1,
                    reason="no AVX512-VNNI here: the interleaved kernel never runs")
@pytest.mark.parametrize("m", [1, 4, 17])
def test_every_other_precision_gives_the_row_major_weights_result(m):
    weight, inter, x, bias = _case((48, 544), True, m, torch.float32)
    mode, _, act = OPS.quant_int8_dot()
    try:
        OPS.quant_int8_dot(1, 16)
        assert activation_bits(inter, m) == 16 and activation_bits(inter, m, 8) == 32
        # The interleaved kernel is int16 only: these widen rows (fp32 path). Same products, but not
        # always the same summation order: on an AMD Zen 5 (AVX-512, 2026-11-29) the two layouts'
        # fp32 sums differ by up to 1.3e-6 on outputs of ~3 (a few ulp); on the Intel Xeons before, 0.
        for per_call in (8, 32):
            assert torch.allclose(quant_matmul(x, inter, bias, per_call), quant_matmul(x, weight, bias, 32),
                                  rtol=1e-5, atol=1e-5)
        OPS.quant_int8_dot(0)  # the integer path off
        assert torch.allclose(quant_matmul(x, inter, bias), quant_matmul(x, weight, bias), rtol=1e-5, atol=1e-5)
    finally:
        OPS.quant_int8_dot(int(mode != 0), act)


def test_interleave_rows_takes_the_modules_the_kernel_reads():
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 20), torch.nn.Linear(64, 32))
    linears = [QuantLinear.from_linear(model[0], "int8"), QuantLinear.from_linear(model[1], "int8"),
               QuantLinear.from_linear(model[2], "int4")]
    linears[0].act = 8  # a module asking for int8 activations keeps its rows
    extra = QuantLinear.from_linear(torch.nn.Linear(64, 32), "int8")
    holder = torch.nn.ModuleList([*linears, extra])
    x = torch.randn(2, 64)
    before = extra(x)
    done = interleave_rows(holder)
    kernel_default = interleaving_default()
    assert done == (1 if kernel_default else 0)
    assert extra.weight_q.interleaved == kernel_default  # 20 rows, int4 and act 8: left as they are
    assert not any(m.weight_q.interleaved for m in linears)
    assert extra.qweight is extra.weight_q.qweight  # the buffer follows the weight
    torch.testing.assert_close(extra(x), before, rtol=1e-5, atol=1e-6)
