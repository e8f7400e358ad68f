"""NVRTC helper for the CuPy kernels: sources, template names, options, compile paths.

Two compile paths share one source and one option set:
- `compile_for_arch` drives NVRTC directly for a named arch (default sm_90). It needs no GPU and no
  driver, so CPU CI compiles every variant and reads ptxas' register/spill report from it.
- `ModuleCache` builds `cupy.RawModule`s for the current device at run time, one per key, filled
  at warm-up (before any CUDA-graph capture) so no step ever waits on the compiler.
cupy is imported inside functions only: CPU paths import this module.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
DECODE_SOURCE = "paged_attention/paged_decode.cu"
CACHE_WRITE_SOURCE = "cache_write/kv_cache_write.cu"

# Compiled variants (kernels.md §2). CTYPES maps the torch dtype name to the CUDA type.
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
# FP8 cache element types (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2): one byte each, decoded on
# load by kernels/fp8.cuh. The query and output keep CTYPES' types.
FP8_CTYPES = {"float8_e4m3fn": "pagoda::fp8_e4m3", "float8_e5m2": "pagoda::fp8_e5m2"}
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32)
# Every GQA ratio of the models served (SmolLM2 3, Qwen2.5 6/7, Qwen3-32B 5); 16 would overflow
# the 48 KiB of static shared memory at head_dim 128.
GROUP_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)
DECODE_THREADS = 128

BASE_OPTIONS = ("-std=c++17", "--use_fast_math")


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


def load_source(relative_path: str) -> str:
    """The source with its quoted #includes pasted in (recursively, each file once).

    NVRTC would find them through -I too, but CuPy's disk cache keys on the source text only:
    pasting the headers in makes a header change a cache miss instead of a stale kernel.
    """
    return _expand_includes(KERNELS_DIR / relative_path, set())


def _expand_includes(path: Path, seen: set[Path]) -> str:
    path = path.resolve()
    if path in seen:
        return ""
    seen.add(path)

    def paste(match: re.Match) -> str:
        header = path.parent / match.group(1)
        text = _expand_includes(header, seen).replace("#pragma once\n", "")
        return f"// ---- {match.group(1)} ----\n{text}"

    return _QUOTED_INCLUDE.sub(paste, path.read_text())


def decode_kernel_name(ctype: str, head_dim: int, block_size: int, group: int,
                       cache_ctype: str | None = None) -> str:
    """cache_ctype: the K/V cache element type; None = the query's (no FP8)."""
    cache = cache_ctype or ctype
    return f"pagoda::paged_decode<{ctype}, {cache}, {head_dim}, {block_size}, {group}, {DECODE_THREADS}>"


def reduce_kernel_name(ctype: str, head_dim: int) -> str:
    return f"pagoda::paged_decode_reduce<{ctype}, {head_dim}>"


def cache_write_kernel_name(ctype: str, cache_ctype: str | None = None) -> str:
    return f"pagoda::kv_cache_write<{ctype}, {cache_ctype or ctype}>"


def all_decode_names() -> list[str]:
    """Every decode and reduce instantiation the backend can launch on a same-dtype cache."""
    names = []
    for ctype in CTYPES.values():
        for head_dim in HEAD_DIMS:
            names.append(reduce_kernel_name(ctype, head_dim))
            for block_size in BLOCK_SIZES:
                names += [decode_kernel_name(ctype, head_dim, block_size, g) for g in GROUP_SIZES]
    return names


def all_fp8_decode_names() -> list[str]:
    """Every decode instantiation over an FP8 cache (their reduce kernels are all_decode_names')."""
    return [decode_kernel_name(ctype, head_dim, block_size, g, cache_ctype)
            for ctype in CTYPES.values() for cache_ctype in FP8_CTYPES.values()
            for head_dim in HEAD_DIMS for block_size in BLOCK_SIZES for g in GROUP_SIZES]


def all_cache_write_names() -> list[str]:
    return [cache_write_kernel_name(ctype, cache_ctype) for ctype in CTYPES.values()
            for cache_ctype in (ctype, *FP8_CTYPES.values())]


def cuda_include_dir() -> str | None:
    """Directory of cuda_fp16.h / cuda_bf16.h matching the installed NVRTC (pip or system)."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    try:
        return find_nvidia_header_directory("cudart")
    except Exception:  # pathfinder raises its own not-found errors
        return None


def compile_options() -> tuple[str, ...]:
    include = cuda_include_dir()
    return BASE_OPTIONS + ((f"-I{include}",) if include else ())


@dataclass(slots=True, frozen=True)
class CompiledProgram:
    cubin: bytes
    lowered_names: dict[str, str]  # name expression -> mangled symbol
    log: str  # NVRTC log, including ptxas -v lines when asked for


def compile_for_arch(source: str, name_expressions: Sequence[str], arch: str = "sm_90",
                     ptxas_verbose: bool = True) -> CompiledProgram:
    """Compile to a cubin for `arch` through NVRTC without touching a GPU.

    Uses CuPy's NVRTC program wrapper (the same NVRTC call RawModule makes; RawModule itself
    queries the device for the arch and fails without a driver). '-ftz=true' mirrors what
    CuPy appends at run time, so the report describes the code that will run.
    """
    from cupy.cuda.compiler import _NVRTCProgram

    options = compile_options() + ("-ftz=true", f"-arch={arch}")
    if ptxas_verbose:
        options += ("-Xptxas=-v",)
    program = _NVRTCProgram(source, "pagoda_kernels.cu", name_expressions=list(name_expressions),
                            method="cubin")
    log = io.StringIO()
    cubin, mapping = program.compile(options, log_stream=log)
    return CompiledProgram(cubin=cubin, lowered_names=dict(mapping or {}), log=log.getvalue())


@dataclass(slots=True, frozen=True)
class KernelResources:
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Per entry function (mangled name): registers, stack frame and spill bytes."""
    frames: dict[str, tuple[int, int, int]] = {}
    registers: dict[str, int] = {}
    entry = props = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            entry = match.group(1)
        elif match := _PROPS.search(line):
            props = match.group(1)
        elif (match := _FRAME.search(line)) and props is not None:
            frames[props] = tuple(int(x) for x in match.groups())
        elif (match := _REGS.search(line)) and entry is not None:
            registers[entry] = int(match.group(1))
    return {name: KernelResources(regs, *frames.get(name, (0, 0, 0)))
            for name, regs in registers.items()}


class ModuleCache:
    """RawModules for the current device keyed by the caller, compiled once each."""

    def __init__(self) -> None:
        self._kernels: dict[object, dict[str, object]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._kernels

    def kernels(self, key: object, source_path: str, names: Sequence[str]) -> dict[str, object]:
        """name expression -> cupy.RawKernel; compiles (and disk-caches via CuPy) on first use."""
        found = self._kernels.get(key)
        if found is None:
            import cupy

            module = cupy.RawModule(code=load_source(source_path), options=compile_options(),
                                    name_expressions=list(names))
            module.compile()
            found = {name: module.get_function(name) for name in names}
            self._kernels[key] = found
        return found
