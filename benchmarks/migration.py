"""Live migration's time to move (docs/reliability.md#live-migration): the launcher with two replicas
sharing a --kv-migrate-dir, one greedy stream with a long prompt (2,000 tokens by default), moved
mid-stream with POST /admin/migrate. Prints the move's figures (export, first token on the target),
the target's prefill tokens computed for it (0 expected), whether the tokens equal an undisturbed
run's, and that undisturbed run's time to first token: what moving by recomputation would cost.

    python -m benchmarks.migration [--model models/smollm2-135m-instruct] [--prompt-tokens 2000]
                                   [--kv-transfer dir|grpc]

--kv-transfer grpc: no shared folder, the target's worker pulls the KV from the source's worker.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx

from benchmarks.peer_server import free_port, start_server, stop_server, wait_ready
from pagoda.v1 import engine_pb2, engine_pb2_grpc


def _stats(target: str) -> engine_pb2.EngineStats:
    with grpc.insecure_channel(target) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=10)


def _stream(url: str, model: str, prompt: list[int], max_tokens: int, on_token=None) -> tuple[list[int], float]:
    """The streamed token ids (logprobs as token ids) and the time to the first one."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True}
    tokens, started, ttft = [], time.monotonic(), 0.0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                for token in (choice.get("logprobs") or {}).get("tokens", []):
                    ttft = ttft or time.monotonic() - started
                    tokens.append(int(token.removeprefix("token_id:")))
                    if on_token is not None:
                        on_token(chunk["id"], len(tokens))
    return tokens, ttft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--move-after", type=int, default=8, help="tokens streamed before the move")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--kv-transfer", default="dir", choices=("dir", "grpc"),
                   help="dir: the workers share a --kv-migrate-dir; grpc: worker to worker, no folder")
    args = p.parse_args()
    http, sched = free_port(), free_port()
    folder = tempfile.mkdtemp(prefix="pagoda-migrate-")
    cmd = [sys.executable, "-m", "pagoda.entrypoints.launcher", "--model", args.model, "--dtype", args.dtype,
           "--data-parallel-size", "2", "--gateway-port", str(http),
           *(["--kv-migrate-dir", folder] if args.kv_transfer == "dir" else ["--kv-transfer", "grpc"]),
           "--grpc-port", str(free_port()), "--scheduler-port", str(sched), "--worker-port", str(free_port())]
    log = Path(folder) / "launcher.log"
    proc = start_server(cmd, dict(os.environ), log)
    url = f"http://127.0.0.1:{http}"
    try:
        _, model = wait_ready(proc, url, args.startup_timeout)
        prompt = [random.Random(0).randrange(100, 40000) for _ in range(args.prompt_tokens)]
        expected, ttft = _stream(url, model, prompt, args.max_tokens)
        schedulers = [f"127.0.0.1:{sched + 10 * i}" for i in range(2)]
        before = [_stats(s) for s in schedulers]
        moved: dict = {}

        def maybe_move(request_id: str, count: int) -> None:
            if count == args.move_after:
                def move() -> None:
                    moved.update(httpx.post(f"{url}/admin/migrate", json={"request_id": request_id},
                                            timeout=120).json())
                threading.Thread(target=move).start()

        tokens, _ = _stream(url, model, prompt, args.max_tokens, maybe_move)
        end = time.monotonic() + 30
        while not moved and time.monotonic() < end:
            time.sleep(0.05)  # the mover thread answers once the target streamed; bounded
        target = moved.get("target", -1)
        prefill = _stats(schedulers[target]).prefill_tokens_computed - before[target].prefill_tokens_computed \
            if target >= 0 else None
        after = _stats(schedulers[target]) if target >= 0 else None
        pulled = {"kv_pulls": after.kv_pulls - before[target].kv_pulls,
                  "kv_pull_fallbacks": after.kv_pull_fallbacks - before[target].kv_pull_fallbacks,
                  "kv_pull_bytes": after.kv_pull_bytes - before[target].kv_pull_bytes} if after else {}
        print(json.dumps({"model": args.model, "prompt_tokens": args.prompt_tokens, "kv_transfer": args.kv_transfer,
                          "move": moved, **pulled,
                          "target_prefill_tokens_computed": prefill, "tokens_identical": tokens == expected,
                          "undisturbed_ttft_seconds": round(ttft, 3)}, indent=2))
    finally:
        stop_server(proc, 120)


if __name__ == "__main__":
    main()
