"""Every CUDA kernel variant compiles for sm_90 through NVRTC (no GPU needed) with 0 spill bytes.

Needs the `cuda` extra (cupy-cuda12x, nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12 for the
fp16/bf16 headers); skips with the reason when it is absent. All 54 decode/reduce variants go
through one NVRTC program (~13 s on one core); the 96 decode variants over FP8 caches through a
second (~25 s). That they compile is what CI knows of the FP8 CUDA path without a GPU; its
arithmetic is checked on the host by tests/unit/test_fp8_codec.py.
"""

from __future__ import annotations

import pytest

from kernels import nvrtc


def _toolchain_missing() -> str | None:
    try:
        from cupy.cuda import nvrtc as cupy_nvrtc

        cupy_nvrtc.getVersion()
    except Exception as exc:  # ImportError, or NVRTC's shared library not found
        return f"NVRTC unavailable ({exc!r}); install the 'cuda' extra"
    if nvrtc.cuda_include_dir() is None:
        return "CUDA runtime headers not found; install nvidia-cuda-runtime-cu12"
    return None


pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))


def _compile(source_path: str, names: list[str]) -> tuple[nvrtc.CompiledProgram, dict]:
    program = nvrtc.compile_for_arch(nvrtc.load_source(source_path), names, arch="sm_90")
    return program, nvrtc.parse_ptxas_report(program.log)


@pytest.fixture(scope="module")
def decode_build():
    names = nvrtc.all_decode_names()
    program, report = _compile(nvrtc.DECODE_SOURCE, names)
    return names, program, report


@pytest.fixture(scope="module")
def fp8_decode_build():
    names = nvrtc.all_fp8_decode_names()
    program, report = _compile(nvrtc.DECODE_SOURCE, names)
    return names, program, report


def _assert_no_local_memory(names, program, report):
    for name in names:
        mangled = program.lowered_names[name]
        resources = report[mangled]
        assert resources.spill_store_bytes == 0 and resources.spill_load_bytes == 0, (name, resources)
        # q, the accumulators and the in-flight loads all stay in registers.
        assert resources.stack_frame_bytes == 0, (name, resources)
        assert 0 < resources.registers <= 255, (name, resources)


def test_every_decode_variant_compiles_for_sm90_without_spills(decode_build):
    names, program, report = decode_build
    assert len(names) == 2 * 3 * (2 * 8 + 1)  # dtypes x head dims x (block sizes x groups + reduce)
    assert program.cubin[:4] == b"\x7fELF"
    _assert_no_local_memory(names, program, report)


def test_report_names_sm90_for_every_entry(decode_build):
    names, program, _ = decode_build
    for name in names:
        assert f"Compiling entry function '{program.lowered_names[name]}' for 'sm_90'" in program.log


def test_every_fp8_cache_decode_variant_compiles_for_sm90_without_spills(fp8_decode_build):
    names, program, report = fp8_decode_build
    # query dtypes x FP8 formats x head dims x block sizes x groups
    assert len(names) == 2 * 2 * 3 * 2 * 8 and len(set(names)) == len(names)
    assert all(", pagoda::fp8_e" in name for name in names)
    _assert_no_local_memory(names, program, report)
    for name in names:
        assert f"Compiling entry function '{program.lowered_names[name]}' for 'sm_90'" in program.log


def test_cache_write_compiles_for_sm90_without_spills():
    names = nvrtc.all_cache_write_names()
    assert len(names) == 2 * 3  # fp16/bf16 rows into their own dtype, e4m3 or e5m2
    program, report = _compile(nvrtc.CACHE_WRITE_SOURCE, names)
    _assert_no_local_memory(names, program, report)


def test_ptxas_report_parser_reads_spills():
    log = (
        "ptxas info    : Compiling entry function '_Z1fv' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1fv\n"
        "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size\n"
    )
    assert nvrtc.parse_ptxas_report(log) == {
        "_Z1fv": nvrtc.KernelResources(registers=255, stack_frame_bytes=24, spill_store_bytes=8,
                                       spill_load_bytes=12)
    }
