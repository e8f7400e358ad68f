"""The sessions workload (`benchmarks.sessions`) replayed in simulated time: for comparing admission
orders where the machine is too busy, or too slow, for the real benchmark (docs/kv_tiers.md, Benchmark).

    python -m benchmarks.sessions_sim [--sessions 32] [--runs off,tier,leases] [--orders fcfs,cached-first]
        [--seeds 0,1,2] [--cost A,B,C,D,E,F | --calibrate benchmarks/results/sessions_32_fcfs_1258.json]
        [--out benchmarks/results/sessions_sim.json]

The real scheduler core (`Scheduler`, its admission, prefix index and host tier) plans every step and
the fake worker executes it; only the worker's time is modelled. The client is the benchmark's: every
session sends its first turn at 0, each later turn an exponential think time (the same seeded draws)
after its last token; in the `leases` run every request names its session (`session_id`, the
gateway's default TTL on the simulated clock). The engine is pipelined as the real one
(`max_inflight_steps` 2: the next plan is made while the worker runs the last). A step computing prefill chunks of `n` tokens after `ctx`
cached or computed ones, decode rows at contexts `ctx`, and host-tier block copies takes

    a + b * sum(n) + c * sum(n * (ctx + n / 2)) / 1e6 + d * rows + e * sum(ctx) / 1e3 + f * copies

seconds (fixed cost, prefill tokens, prefill attention pairs per million, decode rows, decode context
per thousand tokens, blocks copied between host and device). `--calibrate FILE` scales the prefill
terms (b, c) and the per-step terms (a, d, e) of the default so that the replay's durations of `off`
and `tier` under FCFS equal that file's (a real `benchmarks.sessions` run), then replays with them.
What it leaves out: the scheduler's own CPU time (beside the worker's on a small machine), the HTTP
path, and the real prompt's effect on step times beyond its lengths. The workload flags are
benchmarks.sessions' (--sessions, --turns, --first-len, --message-len, --think-time, ...).
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
from dataclasses import asdict, dataclass, replace

from benchmarks.result_file import write_result
from benchmarks.sessions import BLOCK_SIZE, percentile, plan_sessions, pool_blocks, think_times
from benchmarks.sessions import parse_args as sessions_args
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import StepPlan
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

HOST_BLOCK_BYTES = 30 * 2 * 3 * 64 * BLOCK_SIZE * 4  # SmolLM2-135M fp32: layers x K,V x kv heads x dim
SESSION_TTL_S = 600.0  # the gateway's default (gateway/generation.py)
FEATURES = ("steps", "prefill_tokens", "prefill_pairs_m", "decode_rows", "decode_ctx_k", "copies")


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds of one step, per FEATURES (the module's docstring)."""

    a: float = 0.040
    b: float = 0.0010
    c: float = 0.50
    d: float = 0.003
    e: float = 0.004
    f: float = 0.002

    def features(self, plan: StepPlan, worker: FakeWorker) -> tuple[float, ...]:
        """What `plan` computes, read before `worker` executes it."""
        gone = {*plan.finished_ids, *plan.preempted_ids}
        rows = [(state.num_computed, plan.num_scheduled_tokens.get(rid, 1))
                for rid, state in worker.resident.items() if rid not in gone]
        rows += [(new.num_computed_tokens, new.num_scheduled_tokens) for new in plan.new_requests]
        chunks = [(ctx, n) for ctx, n in rows if n > 1]
        decode = [ctx for ctx, n in rows if n == 1]
        steps = 1 if rows else 0  # a plan that only drops finished requests computes nothing
        return (steps, sum(n for _, n in chunks), sum(n * (ctx + n / 2) for ctx, n in chunks) / 1e6,
                len(decode), sum(decode) / 1e3, len(plan.swap_in) + len(plan.swap_out))

    def seconds(self, features: tuple[float, ...]) -> float:
        weights = (self.a, self.b, self.c, self.d, self.e, self.f)
        return sum(w * x for w, x in zip(weights, features, strict=True))


def replay(sessions: list[list[list[int]]], pauses: list[list[float]], config: SchedulerConfig,
           cost: StepCost, output_len: int, order=None, leases: bool = False) -> dict:
    """One run of the workload; `order` (a CachedFirst-like picker) replaces admission's own;
    `leases`: every request names its session (the gateway's default TTL), as the `leases` run."""
    now = [0.0]  # the scheduler's clock (leases expire by it): the simulated one
    sched = Scheduler(config, clock=lambda: now[0])
    if order is not None:  # experiments with pickers not (yet) behind a config value
        sched._admission._order = order
    worker = FakeWorker(config.num_blocks, config.block_size, FakeSampler(vocab_size=50), check_kv=False,
                        num_cpu_blocks=config.num_offload_blocks)
    arrivals = [(0.0, s, 0) for s in range(len(sessions))]  # (time, session, turn), a heap
    times: dict[tuple[int, int], list[float]] = {}  # (session, turn) -> [arrival, first token, last]
    totals = [0.0] * len(FEATURES)
    clock, queued, running = 0.0, [], None  # running: (result, end time)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    while True:
        while arrivals and arrivals[0][0] <= clock:
            at, s, turn = heapq.heappop(arrivals)
            sched.add_request(EngineRequest(RequestId(f"{s}/{turn}"), tuple(sessions[s][turn]), params,
                                            session_id=f"session-{s}" if leases else None,
                                            session_ttl=SESSION_TTL_S if leases else 0.0))
            times[(s, turn)] = [at, -1.0, -1.0]
        while (plan := sched.schedule()) is not None:  # up to max_inflight_steps plans out
            queued.append(plan)
        if running is None and queued:
            plan = queued.pop(0)
            features = cost.features(plan, worker)
            totals = [t + x for t, x in zip(totals, features, strict=True)]
            running = (worker.execute(plan), clock + cost.seconds(features))
        if running is None:
            if not arrivals:
                break
            clock = now[0] = arrivals[0][0]  # idle until the next turn
            continue
        result, clock = running
        running, now[0] = None, clock
        for delta in sched.update(result):
            s, turn = (int(x) for x in delta.request_id.split("/"))
            record = times[(s, turn)]
            if record[1] < 0 and delta.new_token_ids:
                record[1] = clock
            if delta.finish_reason is not None:
                record[2] = clock
                if turn + 1 < len(sessions[s]):
                    heapq.heappush(arrivals, (clock + pauses[s][turn], s, turn + 1))
    assert not sched.has_unfinished_requests() and all(r[2] >= 0 for r in times.values())
    stats = sched.stats()
    return {**summary(times), "prefill_tokens_computed": stats.prefill_tokens_computed,
            "preemptions": stats.num_preemptions, "features": dict(zip(FEATURES, totals, strict=True)),
            "requests": [[s, turn + 1, round(r[0], 2), round(r[1] - r[0], 2), round(r[2] - r[1], 2)]
                         for (s, turn), r in sorted(times.items())]}  # session, turn, arrival, TTFT, decode


def summary(times: dict[tuple[int, int], list[float]]) -> dict:
    """TTFT p50 / p99 of turns 2.. and of first turns, the median time from first token to last
    of turns 2.. (the real run's `predicted_ms`), the run's duration; seconds."""
    later = sorted(r[1] - r[0] for (_, turn), r in times.items() if turn)
    first = sorted(r[1] - r[0] for (_, turn), r in times.items() if not turn)
    return {"ttft_p50_s": round(statistics.median(later), 2), "ttft_p99_s": round(percentile(later, 0.99), 2),
            "first_ttft_p50_s": round(statistics.median(first), 2),
            "first_ttft_p99_s": round(percentile(first, 0.99), 2),
            "decode_p50_s": round(statistics.median(r[2] - r[1] for (_, turn), r in times.items() if turn), 2),
            "duration_s": round(max(r[2] for r in times.values()), 1)}


def scheduler_config(args: argparse.Namespace, sessions: list[list[list[int]]], run: str,
                     admission_order: str) -> SchedulerConfig:
    """The launcher's scheduler for `run` ("off": device pool only, "tier": plus the host tier,
    "leases": the same, the requests name their sessions: `replay(leases=True)`)."""
    num_blocks = pool_blocks(args, sessions)
    offload = int(args.kv_offloading_size * (1 << 30)) // HOST_BLOCK_BYTES if run != "off" else 0
    return SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=8192, eos_token_ids=(2,),
                           admission_order=admission_order, num_offload_blocks=offload)


def calibrate(args: argparse.Namespace, sessions, pauses, real: dict, cost: StepCost, rounds: int = 2) -> StepCost:
    """Scale `cost`'s prefill terms (b, c) and per-step terms (a, d, e) so that the FCFS replays of
    `off` and `tier` last as long as `real`'s runs: two equations, two unknowns, solved on one
    replay's feature totals and repeated (the totals move a little with the times)."""
    for _ in range(rounds):
        rows = []
        for run in ("off", "tier"):
            x = replay(sessions, pauses, scheduler_config(args, sessions, run, "fcfs"), cost, args.output_len)
            f = [x["features"][k] for k in FEATURES]
            prefill = cost.b * f[1] + cost.c * f[2]
            per_step = cost.a * f[0] + cost.d * f[3] + cost.e * f[4]
            rows.append((prefill, per_step, real[run]["duration_s"] - cost.f * f[5]))
        (p1, s1, y1), (p2, s2, y2) = rows
        det = p1 * s2 - p2 * s1
        u, v = (y1 * s2 - y2 * s1) / det, (p1 * y2 - p2 * y1) / det  # Cramer's rule
        cost = replace(cost, b=cost.b * u, c=cost.c * u, a=cost.a * v, d=cost.d * v, e=cost.e * v)
    return cost


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sessions_sim", description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="off,tier", help="off, tier, leases (as benchmarks.sessions')")
    p.add_argument("--orders", default="fcfs,cached-first")
    p.add_argument("--seeds", default="0", help="workload seeds (prompts and pauses), comma-separated")
    p.add_argument("--cost", help="A,B,C,D,E,F of the step-time model (default: StepCost's)")
    p.add_argument("--calibrate", help="a benchmarks.sessions result file: fit the model to its off / tier "
                                       "durations (on the first seed's workload)")
    p.add_argument("--out", default="benchmarks/results/sessions_sim.json")
    args, rest = p.parse_known_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    cost = StepCost(*(float(x) for x in args.cost.split(","))) if args.cost else StepCost()
    if args.calibrate:
        workload = sessions_args([*rest, "--seed", str(seeds[0])])
        with open(args.calibrate) as f:
            cost = calibrate(workload, plan_sessions(workload), think_times(workload), json.load(f), cost)
    print(f"step-time model: {', '.join(f'{k}={v:.4g}' for k, v in asdict(cost).items())}", flush=True)
    rows = {}
    for seed in seeds:
        # --sessions, --turns, --think-time ... as benchmarks.sessions takes them
        workload = sessions_args([*rest, "--seed", str(seed)])
        sessions, pauses = plan_sessions(workload), think_times(workload)
        for order in args.orders.split(","):
            for run in args.runs.split(","):
                name = f"{run}/{order}/seed {seed}"
                rows[name] = replay(sessions, pauses, scheduler_config(workload, sessions, run, order), cost,
                                    workload.output_len, leases=run == "leases")
                print(format_row(name, rows[name]), flush=True)
    workload_args = {k: str(v) for k, v in vars(workload).items() if k != "seed"}
    write_result(args.out, {"cost": asdict(cost), "workload": workload_args, "seeds": seeds, "runs": rows})
    return rows


def format_row(name: str, row: dict) -> str:
    return (f"{name:<30} TTFT turns 2+ p50 {row['ttft_p50_s']:>7} s p99 {row['ttft_p99_s']:>7} s | first turns "
            f"p50 {row['first_ttft_p50_s']:>7} s p99 {row['first_ttft_p99_s']:>7} s | decode {row['decode_p50_s']:>5} s | "
            f"{row['duration_s']:>6} s, "
            f"prefill {row['prefill_tokens_computed']}, preemptions {row['preemptions']}")


if __name__ == "__main__":
    main()
