"""The weight-only quantized linear (worker_svc/models/quant_linear.py, kernels/linear/): every
GGUF format decodes to weights bit-identical to gguf's own dequantiser, the compiled op widens them
bit-identically too, and its products match dequantise-then-matmul within a stated bound."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.worker.gguf_files import gguf_blocks
from tests.worker.int8_dot import activation_bits, activation_rounding_bound
from worker_svc.model_loader import gguf_quants
from worker_svc.model_loader.quant_format import QuantizedWeight, concat, quantize
from worker_svc.models.quant_linear import QuantLinear, _ops, quant_matmul

Q = gguf.GGMLQuantizationType
GGUF_TYPES = list(gguf_quants.DECODERS)


def decoded(type_name: str, rows: int, cols: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    raw = gguf_blocks(type_name, rows, cols, seed)
    weight = gguf_quants.decode(torch.from_numpy(raw.copy()).reshape(-1), type_name, rows, cols)
    return weight, gguf.quants.dequantize(raw, Q[type_name])


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_every_gguf_format_is_represented_bit_for_bit(type_name):
    weight, expected = decoded(type_name, 6, 512)
    bits = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}.get(type_name, 8)
    assert weight.shape == (6, 512) and weight.bits == bits
    np.testing.assert_array_equal(weight.dequantize().numpy(), expected)
    widened = _ops().quant_dequantize(weight.qweight, weight.scales, weight.mins, 512, weight.group,
                                      weight.bits, weight.zero)
    np.testing.assert_array_equal(widened.numpy(), expected)  # the kernel's widening: no FMA either


def test_stored_bytes_per_weight_are_the_files_plus_fp32_scales():
    per_weight = {t: decoded(t, 4, 256)[0].nbytes / (4 * 256) for t in GGUF_TYPES}
    # the codes at the file's bits (8, 4, 5, 6 / 8 B), plus fp32 scales (and mins) per group:
    # Q8_0: 1 + 4/32; Q4_0: 0.5 + 4/32; Q4_1 / Q4_K: 0.5 + 8/32; Q5_0: 0.625 + 4/32;
    # Q5_1 / Q5_K: 0.625 + 8/32; Q6_K: 0.75 + 4/16
    assert per_weight == {"Q8_0": 1.125, "Q4_0": 0.625, "Q4_1": 0.75, "Q5_0": 0.75, "Q5_1": 0.875,
                          "Q4_K": 0.75, "Q5_K": 0.875, "Q6_K": 1.0}


@pytest.mark.parametrize("bits", [5, 6])
def test_low_bit_packing_round_trips(bits):
    from worker_svc.model_loader.quant_format import pack_lowbit, unpack_lowbit

    q = torch.randint(0, 2**bits, (3, 96), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_lowbit(q, bits)
    assert packed.shape == (3, 96 * bits // 8) and torch.equal(unpack_lowbit(packed, bits), q)


def _formats() -> dict[str, QuantizedWeight]:
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(37, 96, generator=gen) * 0.05
    formats = {t: decoded(t, 37, 256, seed=i)[0] for i, t in enumerate(GGUF_TYPES)}
    formats["Q5_0_k96"] = decoded("Q5_0", 37, 96, seed=11)[0]  # a K of 3 blocks, not a power of two
    formats["int8_g32"] = quantize(dense, "int8")
    formats["int4_g32"] = quantize(dense, "int4")
    formats["int8_row_odd_k"] = quantize(torch.randn(37, 75, generator=gen), "int8")  # K % 32 != 0: per row
    return formats


FORMATS = _formats()


@pytest.mark.parametrize("m", [1, 3, 17, 200])  # decode path (<= 32 rows) and the blocked GEMM path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FORMATS))
def test_product_matches_dequantise_then_matmul(name, dtype, m):
    weight = FORMATS[name]
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, weight.shape[1], generator=gen).to(dtype)
    bias = torch.randn(weight.shape[0], generator=gen)
    out = quant_matmul(x, weight, bias)
    assert out.dtype == dtype and out.shape == (m, weight.shape[0])
    w = weight.dequantize().double()
    xd = x.double()
    ref = xd @ w.T + bias.double()
    # Bound: fp32 accumulation over K terms, |error| <= 1e-5 * sum_k |x_k w_k| (observed ~1e-7);
    # bf16 output adds its own rounding, 2^-8 of the value.
    bound = 1e-5 * (xd.abs() @ w.abs().T) + 1e-30
    # 8-bit codes at decode on a VNNI CPU: activations rounded to int16 (or int8) per 32,
    # tests/worker/test_quant_int8_dot.py
    bound = bound + activation_rounding_bound(xd, w, activation_bits(weight, m))
    if dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_parts_of_different_formats_fuse_exactly():
    q4k, q6k, q8 = (decoded(t, r, 256, seed=r)[0] for t, r in (("Q4_K", 5), ("Q6_K", 3), ("Q8_0", 4)))
    fused = concat([q4k, q6k, q8])
    assert (fused.bits, fused.group, fused.mins is not None) == (8, 16, True)  # the common format
    expected = torch.cat([q4k.dequantize(), q6k.dequantize(), q8.dequantize()])
    assert torch.equal(fused.dequantize(), expected)
    same = concat([q4k, decoded("Q4_K", 2, 256, seed=9)[0]])
    assert (same.bits, same.group) == (4, 32)  # alike parts stay int4
    q5 = [decoded("Q5_0", r, 256, seed=r)[0] for r in (3, 2)]
    assert concat(q5).bits == 5 and torch.equal(concat(q5).dequantize(), torch.cat([p.dequantize() for p in q5]))
    mixed = concat([q5[0], q8])  # Q4_K_M's attn_q (Q5_0) with an attn_v in Q8_0
    assert (mixed.bits, mixed.group, mixed.mins) == (8, 32, None)
    assert torch.equal(mixed.dequantize(), torch.cat([q5[0].dequantize(), q8.dequantize()]))


def test_quantize_at_load_round_trip():
    w = torch.randn(64, 128) * 0.05
    for method, tol in (("int8", 0.05 / 127 * 4), ("int4", 0.05 * 8 / 15)):
        q = quantize(w, method)
        err = (q.dequantize() - w).abs().max().item()
        assert err <= tol, (method, err)
    layer = QuantLinear.from_linear(torch.nn.Linear(128, 64, bias=True), "int4")
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (64, 64)
    assert layer(torch.randn(2, 5, 128)).shape == (2, 5, 64)


def test_bad_shapes_are_refused():
    weight = FORMATS["Q8_0"]
    with pytest.raises(RuntimeError, match="group 32 must divide K 255"):
        _ops().quant_linear(torch.randn(1, 255), weight.qweight, weight.scales, None, None, 32, 8, 0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _ops().quant_linear(torch.randn(1, 256).half(), weight.qweight, weight.scales, None, None, 32, 8, 0)


def test_the_portable_path_gives_the_same_products():
    """The AVX2 / scalar path a CPU without AVX-512 takes, forced here in a fresh process (the
    choice is made once per process): same formats, same bound."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from tests.worker.test_quant_linear import FORMATS, test_product_matches_dequantise_then_matmul as t\n"
        "for name in FORMATS:\n"
        "    for dtype in (torch.float32, torch.bfloat16):\n"
        "        for m in (1, 3, 17):\n"
        "            t(name, dtype, m)\n"
        "print('ok')\n")
    env = {**os.environ, "PAGODA_CPU_NO_AVX512": "1", "PAGODA_INT8_DOT": "0"}  # the fp32 path for 8-bit codes too
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
