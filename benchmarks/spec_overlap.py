"""What pipelining could hide with speculation on: per-step time outside the forward pass.

    python -m benchmarks.spec_overlap [--model models/smollm2-135m-instruct] [--k 4]
        [--batch-sizes 1 8] [--served-steps 200]

With speculation on the scheduler keeps one step in flight (docs/speculative_decoding.md,
"Pipelining"). A second step in flight could overlap at most the time the device waits between two
steps: the scheduler's update() and schedule() (proposals and settling included), the plan and
result codecs and the gRPC round trip. This measures those beside the forward pass, on the copy
task of benchmarks/spec_decode.py (greedy, answers forced to 96 tokens, n-gram, K from the goodput
policy), at each batch size:

1. In-process (`LLM`'s scheduler and runner, real model): per step, median ms of schedule(), the
   plan codec (protobuf encode + decode, as the gRPC stream does), the worker's execute() cut into
   forward + sample and the rest (applying the plan, building inputs), the result codec and
   update(); steps with drafts and plain steps apart.
2. Served, the fake worker (answers at once, accepts a draft when its deterministic sampler would
   have produced it): wall ms per step through real processes on loopback with speculation on,
   i.e. the whole per-step overhead a pipelined step could hide, gRPC included.

Prints both, the share of drafted steps whose drafts were all accepted (only those would keep a
step planned ahead), and the bound: outside / (outside + execute) is the most a second step in
flight could save per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.plan_overhead import served_step_seconds
from benchmarks.spec_decode import copy_prompts, timed
from benchmarks.step_breakdown import timed_step
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.tools.default_model import DEFAULT_OUT

PARTS = ("schedule", "plan_codec", "forward_sample", "rest_of_execute", "result_codec", "update")


def in_process(model: str, batch: int, k: int, max_tokens: int = 96) -> dict[str, dict[str, float]]:
    """Median ms per part, {"drafted": ..., "plain": ...} steps of the forced copy task."""
    from pagoda.entrypoints.llm import LLM
    from scheduler_svc.core.request import EngineRequest

    spec = {"method": "ngram", "num_speculative_tokens": k}
    llm = LLM(model, speculative_config=spec, enable_prefix_caching=False, max_num_batched_tokens=2048)
    scheduler, runner = llm.scheduler, llm.runner
    prompts = copy_prompts(llm.tokenizer, batch)
    timed(llm, prompts, max_tokens)  # warm, and trains the goodput policy's cost fit
    for i, prompt in enumerate(prompts):
        scheduler.add_request(EngineRequest(RequestId(f"o{i}"), tuple(prompt["prompt_token_ids"]),
                                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    clock = time.perf_counter
    times: dict[str, dict[str, list[float]]] = {kind: {p: [] for p in PARTS} for kind in ("drafted", "plain")}
    full = 0  # drafted steps in which every sequence's every draft was accepted
    while scheduler.has_unfinished_requests():
        plan, result, parts = timed_step(scheduler, runner, clock)
        if plan.new_requests:
            continue  # the prefill: not a decode step
        model_s = result.forward_seconds + result.sample_seconds
        parts["forward_sample"] = model_s
        parts["rest_of_execute"] = parts.pop("execute") - model_s
        kind = "drafted" if plan.draft_token_ids else "plain"
        if plan.draft_token_ids:
            gained = Counter(result.request_ids)
            full += all(gained[sid] == 1 + len(d) for sid, d in plan.draft_token_ids.items())
        for part, seconds in parts.items():
            times[kind][part].append(seconds * 1e3)
    llm.close()
    out: dict[str, dict[str, float]] = {}
    for kind, parts_ms in times.items():
        if parts_ms["schedule"]:
            out[kind] = {p: round(statistics.median(v), 3) for p, v in parts_ms.items()}
            out[kind]["steps"] = len(parts_ms["schedule"])
    if "drafted" in out:
        out["drafted"]["all_accepted"] = round(full / out["drafted"]["steps"], 3)
    return out


def served_fake(batch: int, k: int, steps: int, logs: Path) -> float:
    """Wall ms per step through the scheduler and fake worker processes, speculation on."""
    from tests.e2e.conftest import start_scheduler, start_worker

    worker = start_worker(None, logs, fake=True, num_gpu_blocks_override=batch * 400, log_level="warning")
    try:
        scheduler = start_scheduler(worker.target, logs, max_num_seqs=batch, max_num_batched_tokens=2048,
                                    speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": k}),
                                    log_level="warning")
        try:
            return asyncio.run(served_step_seconds(scheduler.target, batch, steps)) * 1e3
        finally:
            scheduler.stop()
    finally:
        worker.stop()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_OUT))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--served-steps", type=int, default=200, help="0: skip the served fake-worker part")
    args = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="spec_overlap_"))
    results: dict = {}
    print(f"per-step ms, copy task forced to 96 tokens, n-gram K={args.k} (goodput policy), {args.model}")
    print(f"{'B':>3} {'steps':>9} {'':>6}" + "".join(f"{p:>16}" for p in PARTS) + f"{'outside':>10}{'share':>8}")
    for batch in args.batch_sizes:
        parts = in_process(args.model, batch, args.k)
        results[f"batch{batch}"] = {"in_process_ms": parts}
        for kind, ms in parts.items():
            outside = ms["schedule"] + ms["plan_codec"] + ms["result_codec"] + ms["update"]
            share = outside / (outside + ms["forward_sample"] + ms["rest_of_execute"])
            print(f"{batch:>3} {ms['steps']:>9} {kind:>6}" + "".join(f"{ms[p]:>16.2f}" for p in PARTS)
                  + f"{outside:>10.2f}{share:>8.1%}", flush=True)
        if "drafted" in parts:
            print(f"{batch:>3} drafted steps with every draft accepted: {parts['drafted']['all_accepted']:.0%}",
                  flush=True)
        if args.served_steps:  # after the in-process rows: a worker that fails to start loses nothing
            served = served_fake(batch, args.k, args.served_steps, logs)
            results[f"batch{batch}"]["served_fake_worker_ms_per_step"] = served
            print(f"{batch:>3} served, fake worker (scheduler + gRPC + worker service, no model): "
                  f"{served:.2f} ms/step", flush=True)
    return results


if __name__ == "__main__":
    main()
