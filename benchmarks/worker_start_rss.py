"""The worker's resident memory once started, against the weights' file (issue 35: "RSS at most
~1.2x the file plus the KV cache").

    python -m benchmarks.worker_start_rss --model models/gguf/smollm2-135m-instruct-Q4_K_M.gguf

The base is this process after importing torch, transformers, the compiled extension and the
worker's modules; then `create_runner` loads the model and `initialize` allocates the KV cache
(--kv-cache-memory-bytes, 64 MiB). Prints the RSS above the base, the same after glibc's
malloc_trim (heap pages the load freed but kept), the bytes of the model's own tensors, and the
file's size. docs/quantization.md ("Memory") quotes it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
from pathlib import Path

import torch
import transformers  # noqa: F401 - part of the base: the worker imports it too

from benchmarks.worker_rss import rss_mib
from kernels.cpu_extension import load
from worker_svc.config import WorkerConfig
from worker_svc.parallel.tp_worker import create_runner

MIB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/gguf/smollm2-135m-instruct-Q4_K_M.gguf")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=64 * MIB)
    args = p.parse_args()
    load()
    base = rss_mib()
    runner = create_runner(WorkerConfig(model=args.model, device="cpu",
                                        kv_cache_memory_bytes=args.kv_cache_memory_bytes))
    runner.initialize()
    gc.collect()
    above = rss_mib() - base
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = rss_mib() - base
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in (*runner.model.parameters(), *runner.model.buffers())}
    model_mib = sum(tensors.values()) / MIB
    file_mib = Path(args.model).stat().st_size / MIB if Path(args.model).is_file() else float("nan")
    kv_mib = args.kv_cache_memory_bytes / MIB
    print(f"{args.model} (torch threads {torch.get_num_threads()}): base {base:.0f} MiB")
    print(f"  RSS above base {above:.0f} MiB, after malloc_trim {trimmed:.0f} MiB (KV cache {kv_mib:.0f} MiB)")
    print(f"  model tensors {model_mib:.1f} MiB = {model_mib / file_mib:.2f}x the file ({file_mib:.1f} MiB); "
          f"(RSS - KV) / file = {(above - kv_mib) / file_mib:.2f}x, trimmed {(trimmed - kv_mib) / file_mib:.2f}x")


if __name__ == "__main__":
    main()
