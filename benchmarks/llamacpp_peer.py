"""The peer for `benchmarks.vs_llamacpp`: llama.cpp's `llama-server`, built here, and GGUFs of the model.

    .venv/bin/python -m benchmarks.llamacpp_peer [--model DIR] [--kinds F32,BF16,Q8_0,Q4_K_M]

`ensure_llama_server` creates whatever is missing, each step skipped when its output exists:
1. the sources: the llama.cpp that the `llama-cpp-python` sdist (pinned) vendors, with its git
   metadata (so the build knows its commit), downloaded and unpacked into build/llama.cpp/;
2. the binaries: `llama-server` and `llama-quantize`, built with cmake (CPU only, every x86 vector
   extension this CPU lists but AMX (see GGML_X86), no libcurl: nothing is fetched at run time),
   ~15-35 min on 2 cores; rebuilt when the flags differ from build/llama.cpp/build-flags.txt;
3. the GGUFs in models/gguf/: F32 / BF16 / Q8_0 by llama.cpp's own `convert_hf_to_gguf.py` from the
   HF directory (its vendored `gguf-py` first on the path, `sentencepiece` installed beside the build
   in build/llama.cpp/pydeps/ rather than into .venv), Q4_K_M by `llama-quantize` from the F32 file.
   Each file is written under a temporary name and renamed: a broken run leaves no half file.

`server_argv` is how the benchmark runs it: 2 threads, 16 slots, 12288 tokens of context (768 per
slot: the workload's longest request is 384 + 192), `--alias` so /v1/models names the model the
client asks for.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.peer_server import REPO
from benchmarks.serve import cpu_features

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
BUILD_ROOT = REPO / "build" / "llama.cpp"
SDIST_DIR = BUILD_ROOT / "llama_cpp_python-0.3.36"
SOURCES = SDIST_DIR / "vendor" / "llama.cpp"
BUILD_DIR = BUILD_ROOT / "build"
SERVER_BIN = BUILD_DIR / "bin" / "llama-server"
QUANTIZE_BIN = BUILD_DIR / "bin" / "llama-quantize"
PYDEPS = BUILD_ROOT / "pydeps"  # sentencepiece for the converter, never in .venv
PYTOOLS = BUILD_ROOT / "pytools"  # cmake from PyPI, only where the machine has none
BUILD_STAMP = BUILD_ROOT / "build-flags.txt"  # the flags the binaries were built with
CMAKE_FLAGS = ("-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release")
# ggml's x86 options and the /proc/cpuinfo flags each needs. Not -DGGML_NATIVE=ON: -march=native
# turns on AMX where the CPU lists it, and ggml then runs its AMX kernels, but a VM may list AMX
# without granting its tile state (this Firecracker guest does: `ldtilecfg` faults, llama-server
# dies with SIGSEGV / SIGILL at its first matmul). So every vector extension the CPU has, AMX off.
GGML_X86 = (("GGML_SSE42", ("sse4_2",)), ("GGML_AVX", ("avx",)), ("GGML_AVX2", ("avx2",)),
            ("GGML_AVX_VNNI", ("avx_vnni",)), ("GGML_BMI2", ("bmi2",)), ("GGML_FMA", ("fma",)),
            ("GGML_F16C", ("f16c",)), ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
            ("GGML_AVX512_VBMI", ("avx512vbmi",)), ("GGML_AVX512_VNNI", ("avx512_vnni",)),
            ("GGML_AVX512_BF16", ("avx512_bf16",)))
NO_AMX = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
TARGETS = ("llama-server", "llama-quantize")
GGUF_DIR = REPO / "models" / "gguf"
CONVERTED = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}  # kind -> convert_hf_to_gguf --outtype
QUANTIZED = {"Q4_K_M": "F32"}  # kind -> the file llama-quantize starts from
KINDS = (*CONVERTED, *QUANTIZED)
THREADS, PARALLEL, CTX_SIZE = 2, 16, 12288


def say(message: str) -> None:
    print(f"[llama.cpp peer {time.strftime('%H:%M:%S')}] {message}", flush=True)


def gguf_path(model_dir: str | Path, kind: str) -> Path:
    return GGUF_DIR / f"{Path(model_dir).name}-{kind}.gguf"


def server_argv(gguf: str | Path, port: int, alias: str, threads: int = THREADS, parallel: int = PARALLEL,
                ctx_size: int = CTX_SIZE, binary: Path = SERVER_BIN) -> list[str]:
    """llama-server on one GGUF. --alias: the id /v1/models lists and requests may name (else the
    file's path). --no-webui: nothing to serve but the API."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "--parallel", str(parallel),
            "--ctx-size", str(ctx_size), "--host", "127.0.0.1", "--port", str(port), "--alias", alias,
            "--no-webui"]


def binary_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the built binaries run in: their shared libraries sit beside them, and the
    RUNPATH cmake bakes in is the build folder's absolute path at build time (a checkout moved or
    a worktree removed since leaves it dangling: 'libllama-server-impl.so: not found')."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(SERVER_BIN.parent), env.get("LD_LIBRARY_PATH")) if p)
    return env


def cmake_flags(cpu_flags: list[str] | set[str], machine: str = platform.machine()) -> list[str]:
    """The configure flags for this CPU: its x86 vector extensions named one by one, AMX off;
    elsewhere (no x86 flags to name) ggml's own -march=native."""
    if machine not in ("x86_64", "AMD64"):
        return [*CMAKE_FLAGS, "-DGGML_NATIVE=ON"]
    have = set(cpu_flags)
    return [*CMAKE_FLAGS, "-DGGML_NATIVE=OFF",
            *(f"-D{option}={'ON' if have.issuperset(needs) else 'OFF'}" for option, needs in GGML_X86), *NO_AMX]


def _run_logged(argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = REPO) -> None:
    """Run one step with its output in `log`; its tail in the error when it fails."""
    started = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.run(argv, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{' '.join(argv[:3])} ... exited with {code} (log {log}):\n{tail}")
    say(f"  done in {time.perf_counter() - started:.0f} s (log {log.relative_to(REPO)})")


def ensure_sources() -> Path:
    if (SOURCES / "CMakeLists.txt").is_file():
        return SOURCES
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    sdist = BUILD_ROOT / f"{SDIST_DIR.name}.tar.gz"
    if not sdist.is_file():
        say(f"downloading the {LLAMA_CPP_PYTHON} sdist (~75 MB) ...")
        _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     LLAMA_CPP_PYTHON, "-d", str(BUILD_ROOT)], BUILD_ROOT / "download.log")
    say(f"unpacking {sdist.name} ...")
    with tarfile.open(sdist) as archive:
        archive.extractall(BUILD_ROOT, filter="fully_trusted")  # keeps the vendored git metadata
    return SOURCES


def cmake_binary() -> str:
    """The machine's cmake; else PyPI's `cmake` installed beside the build (not into .venv)."""
    found = shutil.which("cmake") or (str(PYTOOLS / "bin" / "cmake") if (PYTOOLS / "bin" / "cmake").exists()
                                      else None)
    if found:
        return found
    say("no cmake on this machine: installing PyPI's cmake into build/llama.cpp/pytools ...")
    _run_logged([sys.executable, "-m", "pip", "install", "--target", str(PYTOOLS), "cmake"],
                BUILD_ROOT / "pytools.log")
    return str(PYTOOLS / "bin" / "cmake")


def ensure_binaries(jobs: int | None = None) -> list[str]:
    """llama-server and llama-quantize, (re)built when missing or built with other flags; the flags."""
    flags = cmake_flags(cpu_features()["flags"])
    stamp = " ".join(flags)
    if SERVER_BIN.is_file() and QUANTIZE_BIN.is_file() and BUILD_STAMP.is_file() \
            and BUILD_STAMP.read_text().strip() == stamp:
        return flags
    ensure_sources()
    cmake = cmake_binary()
    say(f"configuring llama.cpp ({stamp}) ...")
    _run_logged([cmake, "-S", str(SOURCES), "-B", str(BUILD_DIR), *flags], BUILD_ROOT / "configure.log")
    jobs = jobs or os.cpu_count() or 1
    say(f"building {', '.join(TARGETS)} with {jobs} jobs (~30 min on 2 busy cores; a change of flags "
        "rebuilds ggml-cpu only) ...")
    _run_logged([cmake, "--build", str(BUILD_DIR), "--target", *TARGETS, "-j", str(jobs)],
                BUILD_ROOT / "build.log")
    BUILD_STAMP.write_text(stamp + "\n")
    return flags


def converter_env() -> dict[str, str]:
    """The converter runs on .venv's numpy/torch/transformers, the vendored gguf-py (newer than any
    installed `gguf`) and sentencepiece from PYDEPS."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SOURCES / "gguf-py"), str(PYDEPS)]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def ensure_pydeps() -> None:
    if (PYDEPS / "sentencepiece").is_dir():
        return
    say("installing sentencepiece (the converter's) into build/llama.cpp/pydeps ...")
    _run_logged([sys.executable, "-m", "pip", "install", "--target", str(PYDEPS),
                 "sentencepiece>=0.1.98,<0.3.0"], BUILD_ROOT / "pydeps.log")


def ensure_gguf(model_dir: str | Path, kind: str) -> Path:
    """models/gguf/<model>-<kind>.gguf, made when absent."""
    if kind not in KINDS:
        raise ValueError(f"unknown GGUF kind {kind!r}; choose from {KINDS}")
    target = gguf_path(model_dir, kind)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    if kind in CONVERTED:
        ensure_sources()
        ensure_pydeps()
        say(f"converting {model_dir} to {target.name} ...")
        _run_logged([sys.executable, str(SOURCES / "convert_hf_to_gguf.py"), str(model_dir),
                     "--outtype", CONVERTED[kind], "--outfile", str(partial)],
                    BUILD_ROOT / f"convert-{kind}.log", env=converter_env())
    else:
        source = ensure_gguf(model_dir, QUANTIZED[kind])
        ensure_binaries()
        say(f"quantizing {source.name} to {kind} ...")
        _run_logged([str(QUANTIZE_BIN), str(source), str(partial), kind], BUILD_ROOT / f"quantize-{kind}.log",
                    env=binary_env())
    partial.rename(target)
    return target


def server_version(binary: Path = SERVER_BIN) -> str:
    """`llama-server --version`: 'version: N (commit)' and the compiler line."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, env=binary_env())
    return " / ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip())


def startup_facts(log_text: str) -> list[str]:
    """llama-server's own account (at its default verbosity) of its threads, slots and context per
    slot, without the timestamps."""
    wanted = re.compile(r"threadpool init|n_slots =|n_ctx_slot|kv_unified|system_info|model loaded|listening on|"
                        r"KV buffer|model buffer|CPU_REPACK|file type")
    return list(dict.fromkeys(" ".join(re.sub(r"^[\d.]+ [IWE] ", "", line).split())
                              for line in log_text.splitlines() if wanted.search(line)))


def ensure_llama_server(model_dir: str | Path, kinds: list[str] | tuple[str, ...] = KINDS) -> dict:
    """Everything the benchmark needs, made when missing; what it is (version, flags, files)."""
    started = time.perf_counter()
    flags = ensure_binaries()
    files = {kind: ensure_gguf(model_dir, kind) for kind in kinds}
    return {"source": f"{LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp", "version": server_version(),
            "cmake_flags": flags, "binary": str(SERVER_BIN.relative_to(REPO)),
            "gguf": {kind: {"path": str(path.relative_to(REPO)), "size_bytes": path.stat().st_size}
                     for kind, path in files.items()},
            "ensure_s": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp_peer", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct", help="the HF directory to convert")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"GGUFs to make, comma-separated ({', '.join(KINDS)})")
    args = p.parse_args(argv)
    facts = ensure_llama_server(args.model, args.kinds.split(","))
    say(f"{facts['binary']}: {facts['version']}")
    for kind, file in facts["gguf"].items():
        say(f"{kind:7} {file['path']} ({file['size_bytes'] / 2**20:.1f} MiB)")
    return facts


if __name__ == "__main__":
    main()
