"""The servers `benchmarks.sessions` runs its workload against, one configuration at a time.

- Pagoda (`pagoda.entrypoints.launcher`): `off` (prefix cache on the device pool only), `tier`
  (plus `--kv-offloading-size` GiB of host tier), `leases` (the tier, and every request names its
  session: `session_id`, so a session's history stays pinned between turns and is demoted to the
  host tier under pressure, docs/kv_tiers.md). All with `--enable-request-timings`: each request's
  last chunk carries the scheduler's queue and prefill times.
- vLLM's CPU build (`.venv-vllm`, benchmarks/vllm_peer.py): `vllm` (prefix caching on, its
  default block size, 128 tokens on CPU) and `vllm-offload` (plus its own `--kv-offloading-size`,
  the native CPU-offloading connector). Its device pool gets the same number of tokens as
  Pagoda's (`--num-gpu-blocks-override`, rounded up to whole blocks of its size).
Both engines' counters come from /metrics: Pagoda's prefill tokens computed; vLLM's prefix-cache
queries minus hits (the tokens its prefill computed; a preempted request is queried again when it
resumes, so its recompute counts too).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks import vllm_peer as peer
from benchmarks.scrape import parse_metrics
from pagoda.runtime.math_utils import cdiv

PREFILL = "pagoda:prefill_tokens_computed"
OFFLOADED, LOADED = "pagoda:offloaded_blocks", "pagoda:offload_loaded_blocks"
PREEMPTIONS = "vllm:num_preemptions"
QUERIES, HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
EXTERNAL_QUERIES, EXTERNAL_HITS = "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits"
COUNTERS = (PREFILL, OFFLOADED, LOADED, PREEMPTIONS, QUERIES, HITS, EXTERNAL_QUERIES, EXTERNAL_HITS)
VLLM_BLOCK_SIZE = 128  # vLLM's CPU default (vllm/platforms/cpu.py)


@dataclass(frozen=True, slots=True)
class RunConfig:
    name: str
    engine: str  # "pagoda" or "vllm"
    offload: bool  # the host tier (Pagoda) / the CPU offloading connector (vLLM)
    leases: bool = False  # requests carry session_id (Pagoda only)


RUNS = {run.name: run for run in (
    RunConfig("off", "pagoda", offload=False), RunConfig("tier", "pagoda", offload=True),
    RunConfig("leases", "pagoda", offload=True, leases=True),
    RunConfig("vllm", "vllm", offload=False), RunConfig("vllm-offload", "vllm", offload=True))}
LABELS = {"off": "host tier off", "tier": "host tier on", "leases": "tier + leases",
          "vllm": "vLLM-CPU prefix", "vllm-offload": "vLLM-CPU offload"}


def server_argv(run: RunConfig, model: str, dtype: str, num_tokens: int, max_len: int, offload_gib: float,
                ports: dict[str, int], extra: list[str]) -> list[str]:
    """The command of `run`'s server with a device pool of `num_tokens` tokens (whole blocks).
    vLLM refuses to start with a pool smaller than one request of its max model length, so it
    gets `--max-model-len max_len` (the workload's longest request); Pagoda needs none."""
    if run.engine == "vllm":
        argv = [str(peer.PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--dtype", dtype, "--host", "127.0.0.1", "--port", str(ports["http"]), "--seed", "0",
                "--enable-prefix-caching", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
                "--num-gpu-blocks-override", str(cdiv(num_tokens, VLLM_BLOCK_SIZE)), "--max-model-len", str(max_len)]
        if run.offload:
            argv += ["--kv-offloading-size", str(offload_gib)]
        return argv
    argv = [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", model, "--dtype", dtype,
            "--num-gpu-blocks-override", str(num_tokens // 16), "--enable-request-timings",
            "--gateway-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
            "--scheduler-port", str(ports["scheduler"]), "--worker-port", str(ports["worker"]), *extra]
    if run.offload:
        argv += ["--kv-offloading-size", str(offload_gib)]
    return argv


@contextlib.contextmanager
def serving(run: RunConfig, model: str, dtype: str, num_tokens: int, max_len: int, offload_gib: float,
            extra: list[str], log: Path, startup_timeout: float) -> Iterator[tuple[str, str]]:
    """Start `run`'s server, yield (base URL, its command) once it lists its model, stop it."""
    ports = {name: peer.free_port() for name in ("http", "grpc", "scheduler", "worker")}
    argv = server_argv(run, model, dtype, num_tokens, max_len, offload_gib, ports,
                       extra if run.engine == "pagoda" else [])
    env = peer.peer_env(peer.DEFAULT_KV_GIB) if run.engine == "vllm" else dict(os.environ)
    proc = peer.start_server(argv, env, log)
    try:
        peer.wait_ready(proc, f"http://127.0.0.1:{ports['http']}", startup_timeout)
        yield f"http://127.0.0.1:{ports['http']}", " ".join(argv)
    finally:
        peer.stop_server(proc)


async def counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    response = await client.get(f"{url}/metrics")
    return parse_metrics(response.text, COUNTERS)


def prefill_computed(run: RunConfig, delta: dict[str, float]) -> int:
    """Prompt tokens the engine's prefill computed during the run."""
    if run.engine == "pagoda":
        return int(delta.get(PREFILL, 0))
    hits = delta.get(HITS, 0) + delta.get(EXTERNAL_HITS, 0)  # the offloading connector's hits too
    return int(delta.get(QUERIES, 0) - hits)
