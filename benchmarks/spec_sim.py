"""The forced copy task's speculation ratios, simulated: for comparing draft policies where the
machine is too busy for `benchmarks.spec_decode` (docs/speculative_decoding.md, Figures).

    python -m benchmarks.spec_sim --collect benchmarks/results/spec_sim_data.json   # model runs, minutes
    python -m benchmarks.spec_sim --data benchmarks/results/spec_sim_data.json      # pure Python, seconds

Exact but for the step times: greedy outputs are the same with and without drafts, and an n-gram
proposal is a function of the prompt and the output so far, so every step's proposals, the goodput
policy's cut (the real `choose_draft_lengths`, its cost fit fed the simulated step times) and the
accepted drafts are replayed from the plain run's outputs. A step of M rows takes t(M), a curve of
plain decode steps measured by `--collect` in thread CPU time on one thread (other jobs'
time-slicing drops out; their cache and memory traffic does not). Per-request rates as
spec_decode's: (96 - 1) tokens over each request's time from its first token to its last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from types import SimpleNamespace

from benchmarks.result_file import write_result
from scheduler_svc.core import spec_policy
from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.core.spec.ngram import NgramSpeculator, propose_ngram

MAX_TOKENS, CURVE_ROWS = 96, (1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 56, 64, 72, 80)
Proposer = Callable[[list[int], int, bool], list[int]]  # (tokens, limit, runs alone) -> drafts


def collect(model: str, out: str) -> None:
    import time

    import torch

    from benchmarks.spec_decode import copy_prompts, timed
    from pagoda.entrypoints.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(model, dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=8192)
    prompts = copy_prompts(llm.tokenizer, 8)
    _, outputs, _ = timed(llm, prompts, MAX_TOKENS)
    seconds: dict[int, list[float]] = {}
    execute = llm.runner.execute

    def timed_execute(plan):  # plain decode steps only (a plan with new requests is a prefill)
        started = time.thread_time()
        result = execute(plan)
        if not plan.new_requests:
            seconds.setdefault(len(result.token_ids), []).append(time.thread_time() - started)
        return result

    llm.runner.execute = timed_execute
    for rows in CURVE_ROWS:
        timed(llm, copy_prompts(llm.tokenizer, rows), 7)
    curve = {rows: statistics.median(v) for rows, v in seconds.items() if len(v) >= 3}
    write_result(out, {"prompts": [p["prompt_token_ids"] for p in prompts], "outputs": outputs, "curve": curve})


def curve_fn(curve: dict) -> Callable[[int], float]:
    """Piecewise-linear through the measured points, extended by the last segment."""
    pts = sorted((int(m), v) for m, v in curve.items())

    def t(m: int) -> float:
        for (m0, v0), (m1, v1) in itertools.pairwise(pts):
            if m <= m1:
                return v0 + (v1 - v0) * (max(m, m0) - m0) / (m1 - m0)
        (m0, v0), (m1, v1) = pts[-2], pts[-1]
        return v1 + (v1 - v0) / (m1 - m0) * (m - m1)
    return t


class NgramReplay:
    """The engine's own n-gram proposer (`NgramSpeculator.draft`: uncut alone, cut to the match
    beside others, the batch-mates' outputs too where `batch_lookup`) over replayed sequences."""

    def __init__(self, prompts: list[list[int]], batch_lookup: bool) -> None:
        config = SpeculativeConfig(num_speculative_tokens=16, prompt_lookup_batch=batch_lookup)
        self.speculator = NgramSpeculator(config, None, 0)  # type: ignore[arg-type]  (no blocks here)
        self.seqs = [SimpleNamespace(seq_id=i, token_ids=list(p),
                                     request=SimpleNamespace(num_prompt_tokens=len(p), beam=None))
                     for i, p in enumerate(prompts)]

    def step(self, active: list[int], pos: list[int], outputs: list[list[int]]) -> None:
        for i in active:
            seq = self.seqs[i]
            seq.token_ids[seq.request.num_prompt_tokens:] = outputs[i][:pos[i]]
        self.speculator._alone = len(active) == 1
        self.speculator.running([self.seqs[i] for i in active])  # type: ignore[misc]

    def draft(self, i: int, limit: int) -> list[int]:
        return self.speculator.draft(self.seqs[i], limit)  # type: ignore[arg-type]


def simulate(prompts: list[list[int]], outputs: list[list[int]], t: Callable[[int], float],
             propose: Proposer | NgramReplay | None, k: int = 8,
             fit: spec_policy.StepCostModel | None = None, priced_by_curve: bool = False) -> dict:
    """One batch run; `propose` None: speculation off. `fit`: the engine's step-cost model, carried
    from run to run as in `benchmarks.spec_decode` (None: a fresh one that has seen steps of 8 to
    72 rows); `priced_by_curve`: the policy prices a step by the true curve `t`, not by the line
    the engine fits (what a policy that knew the curve would gain)."""
    n = len(prompts)
    pos, record = [1] * n, [(0.0, 0.0)] * n  # the prefill sampled each first token
    if fit is None:
        fit = spec_policy.StepCostModel()
        for rows in (8, 16, 24, 40, 56, 72) * 5:
            fit.observe(rows, t(rows))
    clock, finished, drafted, accepted = 0.0, [0.0] * n, 0, 0
    active = list(range(n))
    while active:
        proposals = {}
        if isinstance(propose, NgramReplay):
            propose.step(active, pos, outputs)
        for i in active:
            limit = min(k, MAX_TOKENS - pos[i] - 1)
            if propose is None or limit <= 0:
                drafts = []
            elif isinstance(propose, NgramReplay):
                drafts = propose.draft(i, limit)
            else:
                drafts = propose(prompts[i] + outputs[i][:pos[i]], limit, len(active) == 1)
            if drafts:
                proposals[i] = drafts
        line = fit.coefficients()
        lengths = {i: len(d) for i, d in proposals.items()}
        if proposals and line is not None:
            alphas = {i: spec_policy.acceptance_rate(*record[i]) for i in proposals}
            lengths = spec_policy.choose_draft_lengths(lengths, alphas, len(active), len(active),
                                                       t if priced_by_curve else line)
        rows = len(active) + sum(lengths.values())
        fit.observe(rows, t(rows))
        clock += t(rows)
        for i in active:
            drafts, gained = proposals.get(i, [])[:lengths.get(i, 0)], 0
            while gained < len(drafts) and outputs[i][pos[i] + gained] == drafts[gained]:
                gained += 1
            if drafts:
                record[i] = spec_policy.update_record(*record[i], len(drafts), gained)
                drafted, accepted = drafted + len(drafts), accepted + gained
            pos[i] = min(pos[i] + gained + 1, MAX_TOKENS)
            if pos[i] == MAX_TOKENS:
                finished[i] = clock
        active = [i for i in active if pos[i] < MAX_TOKENS]
    rate = statistics.fmean((MAX_TOKENS - 1) / f for f in finished)
    return {"rate": rate, "draft_tokens": drafted, "accepted_tokens": accepted}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_sim", description=__doc__.split("\n")[0])
    p.add_argument("--collect", help="run the model: write the outputs and the step-time curve here")
    p.add_argument("--data", help="simulate from this file (--collect's)")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--uncapped", action="store_true", help="K drafts whatever the match (before issue 33's cut)")
    p.add_argument("--priced-by-curve", action="store_true", help="the policy prices steps by the true curve")
    p.add_argument("--no-batch-lookup", action="store_true", help="own prompt + output only (prompt_lookup_batch off)")
    p.add_argument("--repeats", type=int, default=3, help="runs per batch size, as spec_decode's --repeats")
    args = p.parse_args(argv)
    if args.collect:
        collect(args.model, args.collect)
    data_file = args.data or args.collect
    if not data_file:
        sys.exit("--collect FILE or --data FILE")
    with open(data_file) as f:
        data = json.load(f)
    t = curve_fn(data["curve"])

    def uncapped(tokens: list[int], limit: int, alone: bool) -> list[int]:
        return propose_ngram(tokens, limit, 2, 4)

    # One engine's cost model through the benchmark's runs (batch 1, then batch 8), from a fit that
    # has seen only short steps (the warm-up's): what it learns in one run serves the next.
    fit = spec_policy.StepCostModel()
    for rows in (1, 2, 3) * 6:
        fit.observe(rows, t(rows))
    for batch in (1, 8):
        prompts, outputs = data["prompts"][:batch], data["outputs"][:batch]
        off = simulate(prompts, outputs, t, None)["rate"]
        runs = [simulate(prompts, outputs, t, uncapped if args.uncapped else NgramReplay(prompts, not args.no_batch_lookup),
                         args.k, fit, args.priced_by_curve) for _ in range(args.repeats)]
        on = max(runs, key=lambda r: r["rate"])
        print(f"batch {batch}: per request {on['rate'] / off:.3f}x (runs "
              + " ".join(f"{r['rate'] / off:.3f}x" for r in runs)
              + f"), {on['draft_tokens']} draft tokens, {on['accepted_tokens']} accepted")


if __name__ == "__main__":
    main()
