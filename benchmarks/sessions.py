"""Multi-turn agent sessions with pauses between turns: Pagoda without and with the host tier and
session leases, and vLLM's CPU build with prefix caching, one server at a time.

    python -m benchmarks.sessions [--model models/smollm2-135m-instruct] [--sessions 32] [--turns 6]
        [--first-len 1000] [--message-len 150:300] [--output-len 32] [--think-time 2]
        [--pool-sessions 4] [--kv-offloading-size 4] [--runs off,tier,leases,vllm]
        [--out benchmarks/results/sessions.json]

Each run starts one server (benchmarks/sessions_engines.py: Pagoda's launcher `off` / `tier` /
`leases`, vLLM's OpenAI server `vllm` / `vllm-offload`, on free ports) with its device KV pool
sized (`--num-gpu-blocks-override`) to hold about `--pool-sessions` sessions at their final length,
and stops it before the next starts. N sessions run concurrently; each sends `--turns` streamed
completions, one after the other, its prompt the whole history: the first message (`--first-len`
tokens), then per turn a stand-in for the reply (`--output-len` ids) and a new message. Between
turns the client pauses (exponential think time, mean `--think-time` s, seeded): that is when other
sessions push its blocks out of the device pool. Prompts are token ids (exact lengths), greedy, EOS
ignored, the pauses drawn from the same seeds: every run does the same work.

Prints TTFT p50 / p99 of turns 2.. (turn 1 has nothing to hit), the prompt tokens served from the
cache, and the prefill tokens computed (Pagoda's `pagoda:prefill_tokens_computed_total`, vLLM's
prefix-cache queries minus hits) per run; for Pagoda's runs also where the TTFT of turns 2.. goes,
from the scheduler's per-request timings (queue: arrival to first scheduled; prefill: first
scheduled to first token, host-tier loads included), and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import time
from pathlib import Path

import httpx

from benchmarks import sessions_engines as engines
from benchmarks.result_file import write_result
from benchmarks.serve_client import Endpoint, RequestSpec, send_request, served_model
from benchmarks.sessions_engines import LABELS, RUNS, RunConfig
from pagoda.runtime.math_utils import cdiv
from pagoda.tools.default_model import DEFAULT_OUT

BLOCK_SIZE = 16  # Pagoda's worker default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sessions", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_OUT))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=1000, help="tokens of a session's first message")
    p.add_argument("--message-len", default="150:300", help="MIN:MAX tokens of each later message")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--think-time", type=float, default=2.0, help="mean pause between turns, seconds")
    p.add_argument("--pool-sessions", type=float, default=4.0, help="device pool: this many final sessions")
    p.add_argument("--kv-offloading-size", type=float, default=4.0,
                   help="GiB of host tier (Pagoda's tier runs, vLLM's offload run)")
    p.add_argument("--runs", default="off,tier,leases,vllm",
                   help=f"comma-separated, run in this order, one server at a time: {', '.join(RUNS)}")
    p.add_argument("--vocab", type=int, default=2000, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--extra-flag", action="append", default=[], help="passed to Pagoda's launcher (repeatable)")
    p.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sessions.json"))
    return p.parse_args(argv)


def plan_sessions(args: argparse.Namespace) -> list[list[list[int]]]:
    """Each session's prompts, turn by turn (the same in both runs)."""
    rng = random.Random(args.seed)
    low, high = (int(x) for x in args.message_len.split(":"))
    sessions = []
    for _ in range(args.sessions):
        history = [rng.randrange(10, args.vocab) for _ in range(args.first_len)]
        prompts = [list(history)]
        for _ in range(args.turns - 1):
            history += [rng.randrange(10, args.vocab) for _ in range(args.output_len)]  # the reply
            history += [rng.randrange(10, args.vocab) for _ in range(rng.randint(low, high))]
            prompts.append(list(history))
        sessions.append(prompts)
    return sessions


def think_times(args: argparse.Namespace) -> list[list[float]]:
    """Each session's pauses before its turns 2.. (exponential, mean --think-time, seeded per
    session): the client waits them, benchmarks.sessions_sim replays them."""
    out = []
    for index in range(args.sessions):
        rng = random.Random(args.seed * 1000 + index)
        out.append([rng.expovariate(1 / args.think_time) if args.think_time else 0.0
                    for _ in range(args.turns - 1)])
    return out


def final_length(args: argparse.Namespace, sessions: list[list[list[int]]]) -> int:
    """The longest session's tokens at its end: its last prompt and that turn's output."""
    return max(len(prompts[-1]) for prompts in sessions) + args.output_len


def pool_blocks(args: argparse.Namespace, sessions: list[list[list[int]]]) -> int:
    """The device pool: --pool-sessions final sessions' blocks."""
    return int(args.pool_sessions * cdiv(final_length(args, sessions), BLOCK_SIZE))


async def run_sessions(args: argparse.Namespace, run: RunConfig, url: str, sessions: list[list[list[int]]]) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        endpoint = Endpoint(url, (await served_model(client, url))["id"], timeout_s=1800.0)
        before = await engines.counters(client, url)
        records: list[tuple[int, int, object]] = []
        pauses = think_times(args)

        async def session(index: int, prompts: list[list[int]]) -> None:
            session_id = f"session-{index}" if run.leases else None
            for turn, prompt in enumerate(prompts):
                if turn:  # the person (or the tool call) takes a while: the client waits
                    await asyncio.sleep(pauses[index][turn - 1])
                spec = RequestSpec(prompt, args.output_len, session_id=session_id)
                record = await send_request(client, endpoint, spec)
                if not record.success:
                    raise RuntimeError(f"session {index} turn {turn + 1}: {record.error}")
                records.append((index, turn, record))

        started = time.perf_counter()
        await asyncio.gather(*(session(i, prompts) for i, prompts in enumerate(sessions)))
        duration = time.perf_counter() - started
        after = await engines.counters(client, url)
    later = sorted(r.ttft for _, turn, r in records if turn)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    return {"ttft_p50_ms": round(1000 * statistics.median(later), 1),
            "ttft_p99_ms": round(1000 * percentile(later, 0.99), 1),
            "cached_tokens_later_turns": sum(r.cached_tokens for _, turn, r in records if turn),
            "prompt_tokens": sum(r.prompt_len for _, _, r in records),
            "prefill_tokens_computed": engines.prefill_computed(run, delta),
            "blocks_loaded": int(delta.get(engines.LOADED, 0)), "preemptions": int(delta.get(engines.PREEMPTIONS, 0)),
            "counters": delta, "duration_s": round(duration, 1), "breakdown": breakdown(records),
            "requests": [{"session": i, "turn": turn + 1, "ttft_ms": round(1000 * r.ttft, 1),
                          "prompt_len": r.prompt_len, "cached": r.cached_tokens, "timings": r.timings}
                         for i, turn, r in sorted(records, key=lambda e: (e[0], e[1]))]}


def breakdown(records: list[tuple[int, int, object]]) -> dict:
    """Medians (ms, the scheduler's clock) of where the first token's time went, turn 1 apart from
    turns 2..: queue (arrival to first scheduled: requests ahead of it, admission, the pool) and
    prefill (first scheduled to first token: its chunks, the host tier's loads, the steps it
    shares with other prefills). Empty when the server sent no timings (vLLM)."""
    out = {}
    for label, turns in (("turn 1", {0}), ("turns 2+", None)):
        rows = [r.timings for _, turn, r in records if r.timings and (turn in turns if turns else turn)]
        if rows:
            out[label] = {key: round(statistics.median(t[key] for t in rows), 1)
                          for key in ("queue_ms", "prompt_ms", "ttft_ms", "prompt_n")}
    return out

def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    runs = [RUNS[name] for name in args.runs.split(",")]
    sessions = plan_sessions(args)
    final_len, num_blocks = final_length(args, sessions), pool_blocks(args, sessions)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for run in runs:  # one server at a time: each run has the machine to itself
        log = args.log_dir / f"sessions-{run.name}.log"
        print(f"{LABELS[run.name]}: starting ({log}) ...", flush=True)
        try:
            with engines.serving(run, args.model, args.dtype, num_blocks * BLOCK_SIZE, final_len,
                                 args.kv_offloading_size, args.extra_flag, log, args.startup_timeout) as served:
                results[run.name] = {"command": served[1],
                                     **asyncio.run(run_sessions(args, run, served[0], sessions))}
        except (RuntimeError, TimeoutError) as error:  # one engine failing does not lose the others' runs
            results[run.name] = {"error": f"{type(error).__name__}: {error}", "log": str(log)}
            print(f"  failed: {results[run.name]['error']}", flush=True)
            continue
        print(f"  TTFT p50 {results[run.name]['ttft_p50_ms']} ms, prefill computed "
              f"{results[run.name]['prefill_tokens_computed']}", flush=True)
        write_result(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "num_gpu_blocks": num_blocks,
                                **results})  # so far: a long series interrupted keeps its finished runs
    print(f"\n{args.sessions} sessions x {args.turns} turns, {args.model} ({args.dtype}), first message "
          f"{args.first_len} tokens, later {args.message_len}, {args.output_len} output tokens, think time "
          f"{args.think_time} s; device pool {num_blocks * BLOCK_SIZE} tokens (~{args.pool_sessions:g} "
          f"final sessions); {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(format_table(results))
    write_result(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "num_gpu_blocks": num_blocks,
                            "load_average_after": os.getloadavg(), **results})
    return results


def format_table(results: dict) -> str:
    header = ("run", "TTFT p50 ms", "TTFT p99 ms", "cached (turns 2+)", "prefill computed", "loaded blocks",
              "preemptions")
    lines = [f"{header[0]:<17}" + "".join(f"{h:>18}" for h in header[1:])]
    for name, row in results.items():
        if "error" in row:
            lines.append(f"{LABELS[name]:<17} failed: {row['error']} (see {row['log']})")
            continue
        lines.append(f"{LABELS[name]:<17}" + "".join(f"{row[key]:>18}" for key in (
            "ttft_p50_ms", "ttft_p99_ms", "cached_tokens_later_turns", "prefill_tokens_computed",
            "blocks_loaded", "preemptions")))
    lines.append("\nwhere the first token's time goes (medians, ms, the scheduler's clock; Pagoda only)")
    for name, row in results.items():
        for label, parts in row.get("breakdown", {}).items():
            lines.append(f"{LABELS[name]:<17}{label:<10} queue {parts['queue_ms']:>9}  prefill "
                         f"{parts['prompt_ms']:>9}  TTFT {parts['ttft_ms']:>9}  computed {parts['prompt_n']:>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
