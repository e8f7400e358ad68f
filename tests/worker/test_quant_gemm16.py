"""The quantized linear's prefill rows (M > 32) as an int16 GEMM on AVX512-VNNI
(kernels/linear/cpu_quant_gemm16.cpp): every storage (8-bit, packed 4/5/6-bit, rows interleaved
by 16) against dequantise-then-matmul on the activations it multiplies (int16 per 32), each row
independent of the others, and act 32 / PAGODA_INT16_GEMM=0 giving back the fp32 path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.worker.int8_dot import activation_bits, assert_within_summation_bound, quantized_activations
from tests.worker.test_quant_linear import FORMATS, decoded
from worker_svc.models.quant_linear import _ops, quant_matmul

pytestmark = pytest.mark.skipif(
    _ops() is None or not hasattr(_ops(), "quant_int8_dot") or _ops().quant_int8_dot()[1] != 1,
    reason="needs the AVX512-VNNI kernel")

GEMM_FORMATS = {name: w for name, w in FORMATS.items() if w.shape[1] % 32 == 0}  # K % 32: the GEMM's
ROWS = [33, 70, 257]  # just past the decode rows, a remainder tile of 2, many tiles


def _default_is_int16() -> bool:
    return _ops().quant_int8_dot()[2] == 16


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(GEMM_FORMATS) + ["Q8_0_interleaved"])
def test_matches_dequantise_then_matmul_on_the_int16_activations(name, m):
    weight = decoded("Q8_0", 48, 256)[0].interleave_rows() if name == "Q8_0_interleaved" else GEMM_FORMATS[name]
    if not _default_is_int16() or activation_bits(weight, m) != 16:
        pytest.skip("the GEMM does not take this call here")
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, weight.shape[1], generator=gen) * torch.rand(1, weight.shape[1], generator=gen) * 4
    bias = torch.randn(weight.shape[0], generator=gen)
    out = quant_matmul(x, weight, bias)
    assert_within_summation_bound(out, quantized_activations(x, 16), weight, bias)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "int4_g32"])
def test_each_row_is_the_same_bits_in_any_prompt(name):
    """A row's result depends on that row alone (tiles of 4 and remainders compute alike), so a
    prompt's token gets the same bits prefilled among 40 rows or 257."""
    weight = GEMM_FORMATS[name]
    x = torch.randn(257, weight.shape[1], generator=torch.Generator().manual_seed(1))
    full = quant_matmul(x, weight)
    for rows in (33, 34, 35, 40):
        assert torch.equal(quant_matmul(x[:rows], weight), full[:rows]), rows
    assert torch.equal(quant_matmul(x[5:40], weight), full[5:40])


def test_bf16_activations_round_only_the_output():
    weight = GEMM_FORMATS["Q4_K"]
    x = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    out = quant_matmul(x, weight)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, quant_matmul(x.float(), weight).bfloat16())


def test_act_32_takes_the_fp32_path():
    weight = GEMM_FORMATS["Q5_0"]
    x = torch.randn(48, weight.shape[1], generator=torch.Generator().manual_seed(3))
    w = weight.dequantize().double()
    exact = x.double() @ w.T
    err = (quant_matmul(x, weight, act=32).double() - exact).abs()
    assert (err <= 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30).all()
    assert not torch.equal(quant_matmul(x, weight, act=32), quant_matmul(x, weight))  # the int16 path differs


def test_the_env_switch_turns_it_off():
    """PAGODA_INT16_GEMM=0 (read once per process): prefill rows widen the weights to fp32 again."""
    code = ("import torch; from tests.worker.test_quant_linear import FORMATS; "
            "from worker_svc.models.quant_linear import quant_matmul; w = FORMATS['Q4_K']; "
            "x = torch.randn(48, w.shape[1]); "
            "print(torch.equal(quant_matmul(x, w), quant_matmul(x, w, act=32)))")
    env = dict(os.environ, PAGODA_INT16_GEMM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
