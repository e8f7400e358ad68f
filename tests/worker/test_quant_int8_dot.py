"""The quantized linear's integer dot-product path for 8-bit codes at decode, on a VNNI CPU:
activations rounded per 32 to int16 (the default, cpu_quant_int16dot.cpp: vpdpwssd) or int8
(cpu_quant_int8dot.cpp, llama.cpp's Q8_0 x Q8_0: vpdpbusd), chosen per call (the op's `act`, a
QuantLinear's `act`) or per process (PAGODA_INT8_DOT=0|8|16). Each equals dequantise-then-matmul on
the rounded activations up to fp32 summation and stays within the rounding's own bound of the
exact product; act 32 (or PAGODA_INT8_DOT=0) gives back the fp32 path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.worker.int8_dot import (
    activation_bits,
    activation_rounding_bound,
    assert_within_summation_bound,
    quantized_activations,
)
from tests.worker.test_quant_linear import FORMATS, decoded
from worker_svc.model_loader.quant_format import QuantizedWeight, quantize
from worker_svc.models.quant_linear import QuantLinear, _ops, int8_dot_status, quant_matmul

OPS = _ops()
SUPPORTED = OPS is not None and hasattr(OPS, "quant_int8_dot") and OPS.quant_int8_dot()[1] != 0
pytestmark = pytest.mark.skipif(not SUPPORTED, reason="no AVX512-VNNI / AVX-VNNI here: the integer path never runs")


@pytest.fixture(autouse=True, scope="module")
def _integer_path_on():
    """On with int16 by default whatever PAGODA_INT8_DOT says, restored after this module."""
    mode, _, act = OPS.quant_int8_dot()
    OPS.quant_int8_dot(1, 16)
    yield
    OPS.quant_int8_dot(int(mode != 0), act)


def _with_mins(n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    """8-bit codes with mins: the common format parts of different K-quants fuse into (group 16)."""
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight(qweight=torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8),
                           scales=torch.rand(n, k // group, generator=gen) * 0.01,
                           mins=torch.randn(n, k // group, generator=gen) * 0.01, bits=8, group=group)


def _weights() -> dict[str, QuantizedWeight]:
    gen = torch.Generator().manual_seed(5)
    return {
        # 8-bit codes only: Q5_* and Q6_K are held packed at 5 / 6 bits (cpu_quant_linear_lowbit.cpp)
        "Q8_0": decoded("Q8_0", 37, 256, seed=0)[0],
        "int8_k96": quantize(torch.randn(61, 96, generator=gen) * 0.05, "int8"),  # K % 64 == 32: half a vector
        "int8_n3": quantize(torch.randn(3, 160, generator=gen), "int8"),  # fewer rows than a 4-row tile
        "int8_g64": quantize(torch.randn(19, 192, generator=gen), "int8", group=64),
        "int8_k544": quantize(torch.randn(7, 544, generator=gen), "int8"),  # 17 blocks: past one window of 16
        "mins_g16": _with_mins(13, 96, 16, seed=1),  # two weight scales per block of 32
        "mins_g32": _with_mins(5, 224, 32, seed=2),
    }


WEIGHTS = _weights()
ROWS = [1, 2, 3, 4, 5, 17]
ACTS = [16, 8]


def _case(name: str, dtype: torch.dtype, m: int):
    weight = WEIGHTS[name]
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, weight.shape[1], generator=gen).to(dtype)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    return weight, x, torch.randn(weight.shape[0], generator=gen)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_matches_dequantise_then_matmul_on_the_rounded_activations(name, dtype, m, act):
    weight, x, bias = _case(name, dtype, m)
    assert activation_bits(weight, m, act) == act
    out = quant_matmul(x, weight, bias, act)
    assert out.dtype == dtype and out.shape == (m, weight.shape[0])
    assert_within_summation_bound(out, quantized_activations(x, act), weight, bias)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_within_the_rounding_bound_of_the_exact_product(name, m, act):
    weight, x, bias = _case(name, torch.float32, m)
    w = weight.dequantize().double()
    ref = x.double() @ w.T + bias.double()
    err = (quant_matmul(x, weight, bias, act).double() - ref).abs()
    scale = x.double().abs() @ w.abs().T
    bound = activation_rounding_bound(x, w, act) + 1e-5 * scale
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # typically far inside it: K rounding errors of random sign, each ~0.7% (int8) or ~0.003%
    # (int16) of its term, cancel to that / sqrt(K) of sum |x w|
    step = 0.02 if act == 8 else 0.02 / 256 + 2e-6  # int16: down to fp32 summation's own ~1e-7
    relative = err / (scale + 1e-30)
    assert relative.median() < step / (x.shape[1] - 32 * (x[0, :32] == 0).all().item()) ** 0.5


def test_int16_is_within_fp32_reach_of_the_exact_product():
    """What makes int16 the default: 258x finer steps than int8 leave it ~1e-5 of sum |x w| from
    the exact product (int8: ~1e-3), on SmolLM2's lm_head shape (K = 576)."""
    weight = quantize(torch.randn(256, 576, generator=torch.Generator().manual_seed(3)) * 0.02, "int8")
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(4))
    w = weight.dequantize().double()
    scale = x.double().abs() @ w.abs().T
    rel = {act: ((quant_matmul(x, weight, None, act).double() - x.double() @ w.T).abs() / scale).max().item()
           for act in (8, 16, 32)}
    assert rel[32] < 1e-6 and rel[16] < 2e-5 and rel[8] > 50 * rel[16], rel


def test_act_32_per_call_and_the_switch_give_back_the_fp32_path():
    weight, x, bias = _case("Q8_0", torch.float32, 1)
    w = weight.dequantize().double()
    ref = x.double() @ w.T + bias.double()
    fp32_bound = 1e-5 * (x.double().abs() @ w.abs().T)
    on = quant_matmul(x, weight, bias, 8)
    per_call = quant_matmul(x, weight, bias, 32)  # the path stays on for every other call
    assert OPS.quant_int8_dot()[0] != 0
    try:
        assert OPS.quant_int8_dot(0)[0] == 0 and int8_dot_status()[0] == "off"
        off = quant_matmul(x, weight, bias, 8)  # switched off: the per-call choice no longer applies
    finally:
        OPS.quant_int8_dot(1)
    assert torch.equal(per_call, off)
    assert ((off.double() - ref).abs() <= fp32_bound).all()  # the fp32 path's bound...
    assert ((on.double() - ref).abs() > fp32_bound).any()  # ...which int8 activations exceed
    assert int8_dot_status()[0] in ("avx512_vnni", "avx_vnni")


def test_a_module_carries_its_own_precision():
    weight, x, bias = _case("Q8_0", torch.float32, 3)
    module = QuantLinear(weight.shape[1], weight.shape[0])
    module.set_weight(weight)
    default = module(x)  # act 0: the process default, int16 here
    module.act = 8
    assert torch.equal(default, quant_matmul(x, weight, None, 16))
    assert torch.equal(module(x), quant_matmul(x, weight, None, 8))
    with pytest.raises(RuntimeError, match="act must be"):
        quant_matmul(x, weight, None, 12)


def _in_a_fresh_process(env: dict[str, str], script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_env_switch_int16_by_default():
    script = ("from worker_svc.models.quant_linear import _ops, int8_dot_status\n"
              "print(*_ops().quant_int8_dot(), *int8_dot_status())\n")
    environ = {k: v for k, v in os.environ.items() if k != "PAGODA_INT8_DOT"}
    done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    mode, best, act, kernel, *_ = done.stdout.split()
    assert (mode, act, kernel) == (best, "16", ("avx512_vnni", "avx_vnni")[int(best) - 1])
    assert _in_a_fresh_process({"PAGODA_INT8_DOT": "0"}, script).split()[:4] == ["0", best, "32", "off"]
    assert _in_a_fresh_process({"PAGODA_INT8_DOT": "8"}, script).split()[2] == "8"
    assert _in_a_fresh_process({"PAGODA_INT8_DOT": "16"}, script).split()[2] == "16"


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo").read().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif("avx_vnni" not in _cpu_flags(), reason="no AVX-VNNI on this CPU")
def test_the_avx_vnni_kernels_without_avx512():
    """The 256-bit kernels a CPU without AVX-512 takes (Alder Lake and later), forced here in a
    fresh process (the choice is made once per process): same cases, same bounds, the same exact
    int16 codes (the AVX2 quantization) and fp16 scales."""
    script = (
        "import torch\n"
        "from worker_svc.models.quant_linear import int8_dot_status\n"
        "from tests.worker.test_quant_int8_dot import WEIGHTS, ROWS, ACTS, "
        "test_matches_dequantise_then_matmul_on_the_rounded_activations as tight, "
        "test_within_the_rounding_bound_of_the_exact_product as loose, "
        "test_int16_codes_exactly_on_every_thread as codes, "
        "test_fp16_scales_give_the_fp32_scales_results_bit_for_bit as half\n"
        "assert int8_dot_status()[0] == 'avx_vnni', int8_dot_status()\n"
        "for act in ACTS:\n"
        "    for name in WEIGHTS:\n"
        "        for m in ROWS:\n"
        "            loose(name, m, act)\n"
        "            for dtype in (torch.float32, torch.bfloat16):\n"
        "                tight(name, dtype, m, act)\n"
        "for m in (1, 3, 5):\n"
        "    codes(608, m)\n"
        "    for act in (16, 8, 32):\n"
        "        half(act, m)\n"
        "print('ok')\n")
    assert _in_a_fresh_process({"PAGODA_CPU_NO_AVX512": "1", "PAGODA_INT8_DOT": "16"}, script) == "ok"


def _identity(k: int) -> QuantizedWeight:
    """Codes 1 on the diagonal, scales 1: the op's output row is the activations it multiplied."""
    return QuantizedWeight(qweight=torch.eye(k, dtype=torch.int8), scales=torch.ones(k, k // 32), mins=None,
                           bits=8, group=32)


@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("k", [608, 96])
def test_int16_codes_exactly_on_every_thread(k, m):
    """The activation codes themselves, read back through an identity weight: per block with
    max|x| = 32767 the scale is 1, so out = round_half_even(x) exactly, halves included; a block of
    zeros gives zeros, other blocks the torch restatement's values. K = 608 is 19 blocks (a window of
    16 and a tail of 3) and N = 608 rows split over two threads: each worker must read the calling
    thread's codes (a thread_local buffer named in the worker's lambda read its own, empty one)."""
    gen = torch.Generator().manual_seed(k + m)
    x = torch.randn(m, k, generator=gen) * 5000  # |x| < 32767: 6.5 sigma
    x[:, 0:32:5] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 32766.5, -32766.5])
    x[:, 7], x[:, 40] = 32767.0, -32767.0  # blocks 0 and 1: scale exactly 1
    x[:, 33:64:3] = torch.arange(11) + 100.5  # halves in block 1
    x[-1, 64:96] = 0.0  # an all-zero block
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = quant_matmul(x, _identity(k), None, 16)
    finally:
        torch.set_num_threads(threads)
    exact = torch.round(x[:, :64])  # half to even, as the kernels' conversion
    assert torch.equal(out[:, :64], exact), (out[:, :64] - exact).abs().max()
    assert torch.equal(out[-1, 64:96], torch.zeros(32))
    assert torch.allclose(out.double(), quantized_activations(x, 16), rtol=2**-23, atol=0)


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("act", [16, 8, 32])
def test_fp16_scales_give_the_fp32_scales_results_bit_for_bit(act, m):
    """Q8_0's scales kept as the file's fp16 (keep_half_scales): the integer paths read them as
    they are, the others (fp32 activations, prefill rows) an fp32 copy; the same values either
    way, so the same bits. N = 300 rows split over two threads."""
    weight = decoded("Q8_0", 300, 608, seed=7)[0]
    half = QuantizedWeight(weight.qweight, weight.scales.half(), None, 8, 32)
    assert torch.equal(half.scales.float(), weight.scales) and torch.equal(half.dequantize(), weight.dequantize())
    gen = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, 608, generator=gen), torch.randn(300, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want = quant_matmul(x, half, bias, act), quant_matmul(x, weight, bias, act)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want)


def test_keep_half_scales_only_where_fp16_holds_them():
    from torch import nn

    from worker_svc.models.quant_linear import keep_half_scales

    def linear(weight: QuantizedWeight) -> QuantLinear:
        module = QuantLinear(weight.shape[1], weight.shape[0])
        module.set_weight(weight)
        return module

    gen = torch.Generator().manual_seed(11)
    q8 = decoded("Q8_0", 8, 64, seed=3)[0]  # fp16 in the file
    computed = quantize(torch.randn(8, 64, generator=gen), "int8")  # absmax / 127 in fp32
    model = nn.ModuleList([linear(q8), linear(computed), linear(_with_mins(8, 64, 32, seed=4)), linear(q8)])
    model[3].act = 32  # a module that asks for fp32 activations reads fp32 scales
    x = torch.randn(1, 64, generator=gen)
    before = [m(x) for m in model]
    assert keep_half_scales(model) == 1
    assert [m.weight_q.scales.dtype for m in model] == [torch.float16, torch.float32, torch.float32, torch.float32]
    assert model[0].scales is model[0].weight_q.scales  # the buffer follows (memory accounting)
    assert all(torch.equal(m(x), b) for m, b in zip(model, before, strict=True))


PACKED = {name: w for name, w in FORMATS.items()
          if w.bits in (4, 5, 6)}


@pytest.mark.skipif(not SUPPORTED or OPS.quant_int8_dot()[1] != 1, reason="the packed-code kernel is AVX512-VNNI only")
@pytest.mark.parametrize("m", [1, 3, 4, 17])
@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_codes_match_dequantise_then_matmul_on_the_int16_activations(name, m):
    """Q4_0 / Q4_1 / Q4_K / int4 (groups of 32), Q5_* and Q6_K (groups of 16) widened in registers:
    the integer sums are exact, so only fp32 scaling and summation separate them from the reference
    on the activations rounded to int16; with int8 as the default they keep the fp32 path."""
    weight = PACKED[name]
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, weight.shape[1], generator=gen)
    x[0, :32] = 0.0
    bias = torch.randn(weight.shape[0], generator=gen)
    assert activation_bits(weight, m) == 16
    assert_within_summation_bound(quant_matmul(x, weight, bias), quantized_activations(x, 16), weight, bias)
    w = weight.dequantize().double()
    mode, _, act = OPS.quant_int8_dot()
    try:
        OPS.quant_int8_dot(1, 8)  # int8 by default: packed codes go back to fp32 activations
        assert activation_bits(weight, m) == 32
        exact = x.double() @ w.T + bias.double()
        assert ((quant_matmul(x, weight, bias).double() - exact).abs()
                <= 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30).all()
    finally:
        OPS.quant_int8_dot(int(mode != 0), act)
