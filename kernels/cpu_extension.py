"""Builds and loads the compiled CPU ops (`torch.ops.pagoda_cpu`): paged attention, KV-cache write,
the linear layers (kernels/linear/: the weight-only quantized one and the batch-invariant bf16 one)
and the fused decode stack (kernels/decode/: a pure-decode step of a Llama-family model as one op).

    python -m kernels.cpu_extension     # build once (`make setup` runs it), print the time

The C++ sources are JIT-built by `torch.utils.cpp_extension.load` (ninja) into
build/torch_extensions/ inside the repo (gitignored; PAGODA_CPU_EXTENSION_DIR moves it, e.g. for a
work tree whose build/ is shared with another checkout of different sources), so a clean clone builds them with nothing but
the C++ compiler every Linux CI image has and the `ninja` wheel; `make setup` builds them ahead so
that tests and services only load the library (ninja finds it up to date in milliseconds).

Two processes may load at once (pytest workers, the launcher's services). cpp_extension serialises
them with a lock *file* that a killed build leaves behind, and every later load would then wait on
it forever; an fcntl lock around the whole load is released by the kernel when its holder dies,
and whoever holds it may remove a stale lock file, since no other build can be running.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import sys
import time
from pathlib import Path

import torch

NAME = "pagoda_cpu"
ROOT = Path(__file__).resolve().parents[1]
SOURCES = [Path(__file__).resolve().parent / "paged_attention" / "cpu_attention.cpp",
           Path(__file__).resolve().parent / "linear" / "cpu_bi_linear.cpp",
           Path(__file__).resolve().parent / "linear" / "cpu_quant_linear.cpp",  # weight-only int8/int4
           Path(__file__).resolve().parent / "linear" / "cpu_quant_linear_lowbit.cpp",  # 5/6-bit codes
           Path(__file__).resolve().parent / "linear" / "cpu_quant_int8dot.cpp",  # its VNNI int8 x int8 path
           Path(__file__).resolve().parent / "linear" / "cpu_quant_int16dot.cpp",  # ... and int8 x int16
           Path(__file__).resolve().parent / "linear" / "cpu_quant_gemm16.cpp",  # prefill rows: int16 GEMM
           Path(__file__).resolve().parent / "decode" / "cpu_decode_stack.cpp"]  # fused decode step
HEADERS = [Path(__file__).resolve().parent / "paged_attention" / "cpu_attention_kernel.h",
           Path(__file__).resolve().parent / "paged_attention" / "cpu_attention.h",
           Path(__file__).resolve().parent / "linear" / "cpu_quant_linear.h",
           Path(__file__).resolve().parent / "linear" / "cpu_quant_linear_lowbit.h",
           Path(__file__).resolve().parent / "linear" / "cpu_quant_int8dot.h",
           Path(__file__).resolve().parent / "linear" / "cpu_quant_gemm16.h",
           Path(__file__).resolve().parent / "linear" / "cpu_quant_blocked.h"]
BUILD_ROOT = Path(os.environ.get("PAGODA_CPU_EXTENSION_DIR") or ROOT / "build" / "torch_extensions")
BUILD_DIR = BUILD_ROOT / NAME


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def compile_flags() -> list[str]:
    """-O3 and OpenMP (for `omp simd` reductions and torch's at::parallel_for), plus AVX2/FMA/F16C
    only when this CPU has them. Not -march=native: the library sits in the work tree, which may be
    shared with (or copied to) another machine of the same kind but a different CPU model, and
    native could pick AVX-512 variants that one lacks. AVX2+FMA is where the hot loops get their
    speed (8-wide fused multiply-adds); the portable build without them is correct, only slower.
    -ffp-contract=fast: ISO C++ mode turns FMA contraction off, and the dot products want it."""
    flags = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]
    cpu = _cpu_flags()
    if {"avx2", "fma"} <= cpu:
        flags += ["-mavx2", "-mfma"]
    if "f16c" in cpu:
        flags.append("-mf16c")
    return flags


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` wheel installs it next to the venv's python,
    which is not on PATH when the Makefile or a launcher runs .venv/bin/python directly."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def toolchain_available() -> bool:
    """Whether this machine can build (or has built) the library: a C++ compiler and ninja."""
    if sys.platform != "linux":
        return False
    _put_ninja_on_path()
    from torch.utils.cpp_extension import is_ninja_available

    return shutil.which(os.environ.get("CXX", "c++")) is not None and is_ninja_available()


@functools.cache
def load() -> object:
    """Build if needed, load, and return the op namespace `torch.ops.pagoda_cpu`."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_ROOT / f"{NAME}.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            stale = BUILD_DIR / "lock"  # cpp_extension's own baton: stale while we hold the flock
            stale.unlink(missing_ok=True)
            cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES],
                               extra_cflags=compile_flags(), extra_ldflags=["-fopenmp"],
                               build_directory=str(BUILD_DIR), is_python_module=False,
                               verbose=os.environ.get("PAGODA_BUILD_VERBOSE") == "1")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _register_fakes()
    return torch.ops.pagoda_cpu


def _register_fakes() -> None:
    """Shape-only kernels, so torch.compile can trace through the ops without running them."""

    @torch.library.register_fake("pagoda_cpu::paged_attention")
    def _(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window=0,
          logits_soft_cap=0.0):
        return query.new_empty(query.shape)  # [T, Hq, D], contiguous

    @torch.library.register_fake("pagoda_cpu::write_kv_cache")
    def _(key, value, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.register_fake("pagoda_cpu::quant_linear")
    def _(x, qweight, scales, mins, bias, group, bits, zero, act=0):
        return x.new_empty((x.shape[0], qweight.shape[0]))  # [M, N] in the activation dtype

    @torch.library.register_fake("pagoda_cpu::decode_stack")
    def _(x, positions, cos_sin, norms, weights, scales, mins, biases, meta, k_caches, v_caches, slot_mapping,
          block_tables, seq_lens, query_start_loc, num_heads, num_kv_heads, head_dim, scale, eps, padded_rows):
        return x.new_empty(x.shape)  # [T, hidden]: the final-normed hidden states

    @torch.library.register_fake("pagoda_cpu::quant_dequantize")
    def _(qweight, scales, mins, K, group, bits, zero):
        return scales.new_empty((qweight.shape[0], K))


def main() -> int:
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)  # the Makefile's stamp goes here either way
    if not toolchain_available():
        print("pagoda_cpu: no C++ compiler or ninja here; the CPU backend falls back to torch",
              file=sys.stderr)
        return 0
    start = time.perf_counter()
    load()
    print(f"pagoda_cpu: built/loaded in {time.perf_counter() - start:.1f} s ({BUILD_DIR}, "
          f"flags {' '.join(compile_flags())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
