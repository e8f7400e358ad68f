"""The CUDA kernels' FP8 arithmetic (kernels/fp8.cuh), built as host C++ with g++, against torch.

The header is the one NVRTC compiles into paged_decode.cu and kv_cache_write.cu: every line of the
encode and the decode runs here unchanged, except the device's fp16 -> fp32 conversion (one
hardware cvt), which the host replaces with an exact integer version that is itself checked below
against torch for all 65,536 fp16 codes. No GPU needed: this is how a CPU machine knows that a
CUDA worker reads and writes exactly the bytes the torch and CPU backends do.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kernels import nvrtc

_DRIVER = r"""
#include "fp8.cuh"
using namespace pagoda::fp8;
template <typename F> static void decode_all(float* out) {
    for (unsigned b = 0; b < 256; ++b) out[b] = decode<F>(b);
}
template <typename F> static void encode_all(const float* in, unsigned char* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = (unsigned char)F::from_float(in[i]);
}
extern "C" {
void decode_e4m3(float* out) { decode_all<E4m3>(out); }
void decode_e5m2(float* out) { decode_all<E5m2>(out); }
void encode_e4m3(const float* in, unsigned char* out, long n) { encode_all<E4m3>(in, out, n); }
void encode_e5m2(const float* in, unsigned char* out, long n) { encode_all<E5m2>(in, out, n); }
unsigned scaled_bits(unsigned x, float inv_scale) { return bits_of(scaled_for_encode(float_of(x), inv_scale)); }
void half_bits_to_float_all(float* out) {
    for (unsigned h = 0; h < 65536; ++h) out[h] = half_bits_to_float(h);
}
}
"""

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ on this machine")
    build = tmp_path_factory.mktemp("fp8_codec")
    (build / "driver.cpp").write_text(_DRIVER)
    library = build / "libfp8_codec.so"
    # -std=c++17 (ISO): no FMA contraction; no fast-math, as on the device (which only flushes
    # fp32 denormals: see test_fp32_denormal_inputs_encode_as_zero).
    subprocess.run([compiler, "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{nvrtc.KERNELS_DIR}",
                    "-Wall", "-Werror", str(build / "driver.cpp"), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    for name in ("encode_e4m3", "encode_e5m2"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.scaled_bits.argtypes, lib.scaled_bits.restype = [ctypes.c_uint, ctypes.c_float], ctypes.c_uint
    return lib


def _decode(codec, fmt: str) -> np.ndarray:
    out = np.empty(256, dtype=np.float32)
    getattr(codec, f"decode_{fmt}")(out.ctypes.data_as(ctypes.c_void_p))
    return out


def _encode(codec, fmt: str, values: np.ndarray) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty(values.shape, dtype=np.uint8)
    getattr(codec, f"encode_{fmt}")(values.ctypes.data, out.ctypes.data, values.size)
    return out


def _torch_bytes(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype).view(torch.uint8).numpy()


def test_host_half_conversion_is_exact_for_every_fp16_code(codec):
    out = np.empty(65536, dtype=np.float32)
    codec.half_bits_to_float_all(out.ctypes.data_as(ctypes.c_void_p))
    expected = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float().numpy()
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))  # -0.0 too


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decodes_as_torch_does(codec, fmt):
    out = _decode(codec, fmt)
    expected = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FORMATS[fmt]).float().numpy()
    nan = np.isnan(expected)
    assert nan.sum() == (2 if fmt == "e4m3" else 6)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    if fmt == "e5m2":
        assert out[0x7C] == np.inf and out[0xFC] == -np.inf


def _sweep(fmt: str) -> np.ndarray:
    """Every fp16 and bf16 value (what the kernels actually encode), every midpoint between two
    adjacent codes (ties) and a hair either side of it, the overflow edges, specials, fp32
    denormals and random fp32 values over the whole exponent range."""
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float().numpy()
    bf16s = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().numpy()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FORMATS[fmt]).double().numpy()
    finite = np.unique(codes[np.isfinite(codes)])
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact in fp32: few mantissa bits
    assert np.array_equal(mids.astype(np.float64), (finite[1:] + finite[:-1]) / 2)
    hair = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    top = float(finite.max())
    edges = np.array([top, top * 1.0625, top * 1.125, top * 1.25, top * 2, 1e30, 3.4e38, np.inf, -np.inf,
                      np.nan, -np.nan, 0.0, -0.0], dtype=np.float32)
    edges = np.concatenate([edges, np.nextafter(edges[:5], np.float32(np.inf)),
                            np.nextafter(edges[:5], np.float32(-np.inf))])
    denormals = np.array([1e-45, 1e-40, 1.1754942e-38, -1e-45], dtype=np.float32)
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scaled = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-20, 20, 200_000))).astype(np.float32)
    sweep = np.concatenate([halves, bf16s, mids, -mids, hair, -hair, edges, -edges, denormals, random, scaled])
    return sweep.astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_matches_torch_on_a_sweep(codec, fmt):
    values = _sweep(fmt)
    got, expected = _encode(codec, fmt, values), _torch_bytes(values, FORMATS[fmt])
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, [(float(values[i]), int(got[i]), int(expected[i])) for i in bad[:10]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_round_trips(codec, fmt):
    decoded = _decode(codec, fmt)
    codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(decoded)
    assert np.array_equal(_encode(codec, fmt, decoded[finite]), codes[finite])
    # NaN codes encode back to a NaN code (sign kept); e5m2's infinities to themselves
    back = _encode(codec, fmt, decoded[~finite])
    reread = torch.from_numpy(back).view(FORMATS[fmt]).float().numpy()
    assert np.array_equal(np.isnan(reread), np.isnan(decoded[~finite]))


def test_overflow_semantics_are_torchs():
    # What the header copies: e4m3fn saturates (inf too; it has no inf), e5m2 overflows to inf.
    values = torch.tensor([464.0, 465.0, 1e6, float("inf"), -float("inf"), float("nan")])
    assert torch.equal(values.to(torch.float8_e4m3fn).view(torch.uint8),
                       torch.tensor([0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F], dtype=torch.uint8))
    values = torch.tensor([57344.0, 61439.0, 61440.0, 1e6, float("nan")])
    assert torch.equal(values.to(torch.float8_e5m2).view(torch.uint8),
                       torch.tensor([0x7B, 0x7B, 0x7C, 0x7C, 0x7F], dtype=torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_denormal_inputs_encode_as_zero(codec, fmt):
    # The device flushes fp32 denormals (-ftz=true) before the encode's one fp32 add; that gives the
    # same byte because every fp32 denormal is far below half the smallest FP8 subnormal.
    denormals = np.array([1e-45, 1e-40, 1.1754942e-38], dtype=np.float32)
    assert np.array_equal(_encode(codec, fmt, denormals), np.zeros(3, dtype=np.uint8))
    assert np.array_equal(_encode(codec, fmt, -denormals), np.full(3, 0x80, dtype=np.uint8))


def test_scaling_keeps_a_nans_bits(codec):
    # torch's fp32 -> bf16 makes NaN 0xffff (negative) and `.to(float8)` keeps the sign (0xff); the
    # cache write must not let a multiply canonicalise it. The host multiply would keep it anyway:
    # this checks the select the device needs is there and leaves numbers alone.
    bf16_nan = torch.tensor([float("nan")]).to(torch.bfloat16).float().view(torch.int32).item() & 0xFFFFFFFF
    for bits in (bf16_nan, 0x7FC00000, 0xFFC00001, 0x7F800001):
        assert codec.scaled_bits(bits, 0.5) == bits
    assert codec.scaled_bits(0x40400000, 0.5) == 0x3FC00000  # 3.0 * 0.5
    assert codec.scaled_bits(0xFF800000, 0.25) == 0xFF800000  # -inf stays -inf


def test_nvrtc_sources_paste_the_header_in():
    # CuPy's disk cache keys on the source text: a header edit must change it.
    for path in (nvrtc.DECODE_SOURCE, nvrtc.CACHE_WRITE_SOURCE):
        source = nvrtc.load_source(path)
        assert '#include "' not in source and "#pragma once" not in source
        assert source.count("struct E4m3 {") == 1 and source.count("struct fp8_e4m3 {") == 1
