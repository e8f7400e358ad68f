"""The quantized linear's int8 dot-product path (kernels/linear/cpu_quant_int8dot.cpp): 8-bit codes
times activations rounded to int8 per 32, on a VNNI CPU. It equals dequantise-then-matmul on the
rounded activations up to fp32 summation, stays within the rounding's own bound of the exact
product; the path is opt-in (PAGODA_INT8_DOT=1, or the op's switch), off gives back the fp32 path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.worker.int8_dot import activation_rounding_bound, int8_dot_applies, quantized_activations
from tests.worker.test_quant_linear import decoded
from worker_svc.model_loader.quant_format import QuantizedWeight, quantize
from worker_svc.models.quant_linear import _ops, int8_dot_status, quant_matmul

OPS = _ops()
SUPPORTED = OPS is not None and hasattr(OPS, "quant_int8_dot") and OPS.quant_int8_dot()[1] != 0
pytestmark = pytest.mark.skipif(not SUPPORTED, reason="no AVX512-VNNI / AVX-VNNI here: the int8 path never runs")


@pytest.fixture(autouse=True, scope="module")
def _int8_path_on():
    """The path is opt-in (PAGODA_INT8_DOT=1); the op's switch turns it on for this module only."""
    OPS.quant_int8_dot(1)
    yield
    OPS.quant_int8_dot(0)


def _weights() -> dict[str, QuantizedWeight]:
    gen = torch.Generator().manual_seed(5)
    return {
        # 8-bit codes only: Q5_* and Q6_K are held packed at 5 / 6 bits (cpu_quant_linear_lowbit.cpp)
        "Q8_0": decoded("Q8_0", 37, 256, seed=0)[0],
        "int8_k96": quantize(torch.randn(61, 96, generator=gen) * 0.05, "int8"),  # K % 64 == 32: half a vector
        "int8_n3": quantize(torch.randn(3, 160, generator=gen), "int8"),  # fewer rows than a 4-row tile
        "int8_g64": quantize(torch.randn(19, 192, generator=gen), "int8", group=64),
    }


WEIGHTS = _weights()
ROWS = [1, 2, 3, 4, 5, 17]


def _case(name: str, dtype: torch.dtype, m: int):
    weight = WEIGHTS[name]
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, weight.shape[1], generator=gen).to(dtype)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    return weight, x, torch.randn(weight.shape[0], generator=gen)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_matches_dequantise_then_matmul_on_the_rounded_activations(name, dtype, m):
    weight, x, bias = _case(name, dtype, m)
    assert int8_dot_applies(weight, m)
    out = quant_matmul(x, weight, bias)
    assert out.dtype == dtype and out.shape == (m, weight.shape[0])
    w = weight.dequantize().double()
    xq = quantized_activations(x)
    ref = xq @ w.T + bias.double()
    # int32 products are exact; what is left is fp32 scaling and summation over K / 32 blocks
    bound = 1e-5 * (xq.abs() @ w.abs().T) + 1e-30
    if dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_within_the_rounding_bound_of_the_exact_product(name, m):
    weight, x, bias = _case(name, torch.float32, m)
    w = weight.dequantize().double()
    ref = x.double() @ w.T + bias.double()
    err = (quant_matmul(x, weight, bias).double() - ref).abs()
    bound = activation_rounding_bound(x, w) + 1e-5 * (x.double().abs() @ w.abs().T)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # typically far inside it: K rounding errors of random sign, each ~0.7% of its term, cancel to
    # ~0.007 / sqrt(K) of sum |x w| (0.1% at K = 64)
    relative = err / (x.double().abs() @ w.abs().T + 1e-30)
    assert relative.median() < 0.02 / (x.shape[1] - 32 * (x[0, :32] == 0).all().item()) ** 0.5


def test_the_switch_gives_back_the_fp32_path():
    weight, x, bias = _case("Q8_0", torch.float32, 1)
    w = weight.dequantize().double()
    ref = x.double() @ w.T + bias.double()
    fp32_bound = 1e-5 * (x.double().abs() @ w.abs().T)
    on = quant_matmul(x, weight, bias)
    try:
        assert OPS.quant_int8_dot(0)[0] == 0 and int8_dot_status()[0] == "off"
        off = quant_matmul(x, weight, bias)
    finally:
        OPS.quant_int8_dot(1)
    assert ((off.double() - ref).abs() <= fp32_bound).all()  # the fp32 path's bound...
    assert ((on.double() - ref).abs() > fp32_bound).any()  # ...which rounded activations exceed
    assert int8_dot_status()[0] in ("avx512_vnni", "avx_vnni")


def _in_a_fresh_process(env: dict[str, str], script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_env_switch_is_opt_in():
    script = ("from worker_svc.models.quant_linear import _ops, int8_dot_status\n"
              "print(_ops().quant_int8_dot()[0], *int8_dot_status())\n")
    assert _in_a_fresh_process({"PAGODA_INT8_DOT": "0"}, script).startswith("0 off opt-in")
    assert _in_a_fresh_process({"PAGODA_INT8_DOT": "1"}, script).split()[1] in ("avx512_vnni", "avx_vnni")


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo").read().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif("avx_vnni" not in _cpu_flags(), reason="no AVX-VNNI on this CPU")
def test_the_avx_vnni_kernel_without_avx512():
    """The 256-bit kernel a CPU without AVX-512 takes (Alder Lake and later), forced here in a
    fresh process (the choice is made once per process): same cases, same bounds."""
    script = (
        "import torch\n"
        "from worker_svc.models.quant_linear import int8_dot_status\n"
        "from tests.worker.test_quant_int8_dot import WEIGHTS, ROWS, "
        "test_matches_dequantise_then_matmul_on_the_rounded_activations as tight, "
        "test_within_the_rounding_bound_of_the_exact_product as loose\n"
        "assert int8_dot_status()[0] == 'avx_vnni', int8_dot_status()\n"
        "for name in WEIGHTS:\n"
        "    for m in ROWS:\n"
        "        loose(name, m)\n"
        "        for dtype in (torch.float32, torch.bfloat16):\n"
        "            tight(name, dtype, m)\n"
        "print('ok')\n")
    assert _in_a_fresh_process({"PAGODA_CPU_NO_AVX512": "1", "PAGODA_INT8_DOT": "1"}, script) == "ok"
