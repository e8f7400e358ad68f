"""Worker memory over a long run, in one process: the scheduler core drives the real ModelRunner
with a soak-like stream of requests (random prompt lengths, output lengths, arrivals and aborts),
so every step has another batch shape, and the worker's RSS is sampled every N steps.

    python -m benchmarks.worker_rss --model models/pagoda-tiny --steps 20000 --every 1000
    MALLOC_ARENA_MAX=2 python -m benchmarks.worker_rss ...        # glibc knobs: environment
    python -m benchmarks.worker_rss --malloc-trim ...             # malloc_trim(0) after each step
    python -m benchmarks.worker_rss --tracemalloc ...             # Python heap: top-10 diffs
    python -m benchmarks.worker_rss --no-warmup ...               # row buckets built as met, not at start

Each sample prints RSS (VmRSS), glibc's view (mallinfo2: arena bytes in use / free, mmapped),
the distinct step token counts seen so far and the worker's resident requests. It ends with one
JSON object (the samples), which docs/reliability.md quotes ("Worker memory").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import time
import tracemalloc

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import EngineRequest
from scheduler_svc.core.scheduler import Scheduler
from worker_svc.config import WorkerConfig
from worker_svc.parallel.tp_worker import create_runner

_libc = ctypes.CDLL("libc.so.6")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


_libc.mallinfo2.restype = _Mallinfo2


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def malloc_view() -> dict[str, float]:
    """glibc's counters in MiB: heap bytes in use, free inside the heaps, mmapped chunks."""
    info = _libc.mallinfo2()
    mib = 2**20
    return {"arena_in_use": round(info.uordblks / mib, 1), "arena_free": round(info.fordblks / mib, 1),
            "mmapped": round(info.hblkhd / mib, 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker_rss", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pagoda-tiny")
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--every", type=int, default=1_000, help="sample every N steps")
    p.add_argument("--concurrency", type=int, default=32, help="requests kept in flight")
    p.add_argument("--max-prompt", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--abort-fraction", type=float, default=0.2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 * 2**20)
    p.add_argument("--no-pack", action="store_true", help="plain nn.Linear, no oneDNN packing")
    p.add_argument("--no-buckets", action="store_true",
                   help="packed linears see every row count (the worker before worker_svc/models/row_buckets.py)")
    p.add_argument("--no-warmup", action="store_true",
                   help="meet the row buckets under load instead of building them all at start")
    p.add_argument("--malloc-trim", action="store_true", help="malloc_trim(0) after every step")
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.no_buckets:
        import worker_svc.model_runner

        worker_svc.model_runner.bucket_linear_rows = lambda model, kind: 0
    config = WorkerConfig(model=args.model, device="cpu", kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          pack_weights=not args.no_pack, warmup_row_buckets=not args.no_warmup)
    runner = create_runner(config, max_num_batched_tokens=args.max_num_batched_tokens)
    before_init = time.monotonic()
    info = runner.initialize()  # the row buckets' warm-up included (unless --no-warmup)
    print(json.dumps({"initialize_seconds": round(time.monotonic() - before_init, 2), "rss_mib": round(rss_mib(), 1)}),
          file=sys.stderr, flush=True)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
        max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
        eos_token_ids=info.eos_token_ids))
    rng = random.Random(args.seed)
    shapes: set[int] = set()  # the steps' token counts
    runner.model.register_forward_pre_hook(lambda _module, inputs: shapes.add(inputs[0].shape[0]))
    live: set[RequestId] = set()
    counter = 0
    samples = []
    snapshot = None
    if args.tracemalloc:
        tracemalloc.start(8)
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        while len(live) < args.concurrency:
            rid = RequestId(str(counter))
            counter += 1
            prompt = tuple(rng.randrange(1, min(info.vocab_size, 1000)) for _ in range(rng.randint(1, args.max_prompt)))
            sampling = SamplingParams(max_tokens=rng.randint(1, args.max_tokens), ignore_eos=True,
                                      temperature=0.0 if rng.random() < 0.5 else 1.0, seed=rng.randrange(2**31))
            scheduler.add_request(EngineRequest(rid, prompt, sampling))
            live.add(rid)
        if rng.random() < args.abort_fraction / args.max_tokens * 4:  # about abort_fraction of requests
            victim = rng.choice(sorted(live))
            scheduler.abort(victim)
            live.discard(victim)
        plan = scheduler.schedule()
        if plan is None:
            continue
        for delta in scheduler.update(runner.execute(plan)):
            if delta.finish_reason is not None:
                live.discard(delta.request_id)
        if args.malloc_trim:
            _libc.malloc_trim(0)
        if step % args.every == 0 or step == 1:
            sample = {"step": step, "requests": counter, "rss_mib": round(rss_mib(), 1), **malloc_view(),
                      "distinct_token_counts": len(shapes), "resident": runner.num_resident,
                      "seconds": round(time.monotonic() - started, 1)}
            samples.append(sample)
            print(json.dumps(sample), file=sys.stderr, flush=True)
            if args.tracemalloc:
                current = tracemalloc.take_snapshot()
                if snapshot is not None:
                    for stat in current.compare_to(snapshot, "lineno")[:10]:
                        print("   ", stat, file=sys.stderr)
                snapshot = current
    report = {"args": vars(args), "samples": samples}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
