"""The scheduler core's Python memory under a soak-shaped load, per cached block and per request.

    python -m benchmarks.scheduler_memory [--num-blocks 4096] [--num-requests 12000] [--every 1000]
                                          [--top 10]

Drives the real `Scheduler` (prefix caching on) with the fake worker, as benchmarks.soak drives the
services: `--concurrency` requests in flight, random prompts of `--prompt-len` ids below
`--vocab-size`, `--max-tokens` each, a tenth aborted at a random step. Prints, every `--every`
finished requests, the memory tracemalloc sees allocated by the scheduler (the fake worker's own
bookkeeping is left out) and the prefix index's size; then the bytes per cached block while the
index fills (to the first full row) and the drift once it is full. `--top N` prints the N source
lines whose memory grew most between the first full row and the last (where a creep comes from).
docs/reliability.md ("Scheduler memory") quotes it.
"""

from __future__ import annotations

import argparse
import gc
import random
import tracemalloc

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeWorker

BLOCK_SIZE = 16
KIB = 1024


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--num-requests", type=int, default=12000)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=0, help="print the N lines that grew most once full")
    return p.parse_args(argv)


class _NoKV(list):
    """The fake worker's KV slots, writes dropped: it would keep every cached block's token ids
    alive (they are the driver's int objects, counted as the scheduler's otherwise). Nothing reads
    them: check_kv is off and no plan swaps, offloads or migrates."""

    def __setitem__(self, key, value) -> None:
        pass


def scheduler_bytes() -> int:
    """Traced bytes, less what the fake worker allocated (its own per-request records)."""
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, "*/worker_svc/fake/*")])
    return sum(stat.size for stat in snap.statistics("filename"))


def run(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(finished requests, scheduler bytes, cached blocks) every `--every` requests."""
    config = SchedulerConfig(num_blocks=args.num_blocks, block_size=BLOCK_SIZE, max_model_len=2048,
                             max_num_seqs=args.concurrency, max_num_batched_tokens=2048,
                             enable_prefix_caching=True, max_inflight_steps=1)
    scheduler = Scheduler(config)
    worker = FakeWorker(args.num_blocks, BLOCK_SIZE, check_kv=False)
    worker.kv = _NoKV()
    index = scheduler._kv.index  # noqa: SLF001 - what is measured
    rng = random.Random(args.seed)
    aborts: dict[RequestId, int] = {}  # request -> the step it is aborted at
    sent = finished = step = 0
    next_row = 0  # the first row: the scheduler before any request
    rows: list[tuple[int, int, int]] = []
    snapshots: list[tracemalloc.Snapshot] = []

    def send() -> None:
        nonlocal sent
        rid = RequestId(f"r{sent}")
        # New int objects per prompt, as the gRPC parse makes them (ids above the small-int cache).
        prompt = tuple(int(str(rng.randrange(1, args.vocab_size))) for _ in range(args.prompt_len))
        scheduler.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=args.max_tokens,
                                                                        ignore_eos=True)))
        if rng.random() < args.abort_fraction:
            aborts[rid] = step + rng.randrange(1, args.max_tokens + 2)
        sent += 1

    while finished < args.num_requests:
        while sent - finished < args.concurrency and sent < args.num_requests:
            send()
        step += 1
        for rid in [r for r, at in aborts.items() if at <= step]:
            del aborts[rid]
            finished += len(scheduler.abort(rid))
        plan = scheduler.schedule()
        if plan is None:
            continue
        for delta in scheduler.update(worker.execute(plan)):
            if delta.finished:
                finished += 1
                aborts.pop(delta.request_id, None)
                worker.sampled.pop(delta.request_id, None)
        if finished >= next_row:
            next_row += args.every
            gc.collect()
            rows.append((finished, scheduler_bytes(), len(index)))
            if args.top:
                snapshots.append(tracemalloc.take_snapshot())
            print(f"{finished:>7} requests  {rows[-1][1] / KIB / KIB:8.3f} MiB  "
                  f"{rows[-1][2]:>6} cached blocks", flush=True)
    scheduler.check_invariants()
    if args.top and len(snapshots) > 2:
        full = next((i for i, r in enumerate(rows) if r[2] >= args.num_blocks - args.concurrency), 1)
        for first, last in ((0, full), (full, len(rows) - 1)):
            print(f"grew most from request {rows[first][0]} to {rows[last][0]}:")
            for stat in snapshots[last].compare_to(snapshots[first], "lineno")[:args.top]:
                print(f"  {stat}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    tracemalloc.start(1 if not args.top else 8)
    rows = run(args)
    # (full: within one request per slot of the pool; the running requests hold the rest)
    first_full = next((r for r in rows if r[2] >= args.num_blocks - args.concurrency), None)
    start = rows[0]
    if first_full is not None and first_full[2] > start[2]:
        per_block = (first_full[1] - start[1]) / (first_full[2] - start[2])
        print(f"filling: {per_block:.0f} bytes per cached block "
              f"(requests {start[0]} -> {first_full[0]}, {start[2]} -> {first_full[2]} blocks)")
        after = [r for r in rows if r[0] >= first_full[0]]
        if len(after) > 1:
            drift = (after[-1][1] - after[0][1]) / (after[-1][0] - after[0][0]) * 1000
            print(f"full: {drift / KIB:+.1f} KiB per 1,000 requests (requests {after[0][0]} -> {after[-1][0]})")


if __name__ == "__main__":
    main()
