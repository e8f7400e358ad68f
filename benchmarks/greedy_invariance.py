"""How often a soak request's greedy output depends on how it was computed (issue 32), in-process.

    python -m benchmarks.greedy_invariance [--model models/pagoda-tiny] [--num-requests 200]
        [--max-tokens 8] [--seed 0] [--out FILE.json]

The fault soak (benchmarks/soak.py) compares every greedy stream with an undisturbed pass; the
10k run had one mismatch (request 4,098). This replays the soak's own requests
(benchmarks/soak_requests.py, the same seed and shapes) through the LLM engine in three ways
and counts the requests whose tokens differ from the request run alone:
- batch: the prompts 32 at a time, as the undisturbed pass sends them;
- continuation: for every k in 1..max_tokens-1, prompt + the first k tokens resubmitted as a
  failover continuation (`num_prior_output_tokens=k`), all k of a request in one step.
PAGODA_FUSED_DECODE=0 measures the module loop instead of the fused op (worker_svc/models/fused_decode.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

from benchmarks.result_file import write_result
from benchmarks.soak_requests import plan_request
from pagoda import LLM, SamplingParams
from pagoda.contract.ids import RequestId
from scheduler_svc.core import EngineRequest

_ids = itertools.count()


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams, int]]) -> list[list[int]]:
    """Tokens of each (prompt, sampling, prior output tokens), all added before the first step."""
    out: dict[RequestId, list[int]] = {}
    for prompt, sampling, prior in requests:
        rid = RequestId(f"g{next(_ids)}")
        llm.scheduler.add_request(EngineRequest(rid, tuple(prompt), sampling, num_prior_output_tokens=prior))
        out[rid] = []
    while llm.scheduler.has_unfinished_requests():
        for delta in llm.scheduler.update(llm.runner.execute(llm.scheduler.schedule())):
            out[delta.request_id] += delta.new_token_ids
    return list(out.values())


def soak_prompts(args: argparse.Namespace) -> dict[int, list[int]]:
    """{index: prompt} of the soak's first valid requests (its default flags but --max-tokens)."""
    soak = argparse.Namespace(seed=args.seed, bad_fraction=0.02, quota_api_key=None, quota_fraction=0.0,
                              vocab_size=1000, prompt_len=24, max_tokens=args.max_tokens, stream_fraction=0.6,
                              cancel_fraction=0.1, max_cancel_delay=0.05)
    prompts: dict[int, list[int]] = {}
    for index in itertools.count(args.first):
        if len(prompts) == args.num_requests:
            return prompts
        planned = plan_request(index, soak)
        if planned.kind == "normal":
            prompts[index] = planned.body["prompt"]
    raise AssertionError("unreachable")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pagoda-tiny")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--first", type=int, default=0, help="the soak index to start at")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    prompts = soak_prompts(args)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(model=args.model, dtype="float32", device="cpu", num_gpu_blocks_override=2048,
             enable_prefix_caching=False) as llm:
        alone = {i: run(llm, [(prompt, sampling, 0)])[0] for i, prompt in prompts.items()}
        batch: dict[int, list[int]] = {}
        order = sorted(prompts)
        for start in range(0, len(order), 32):
            chunk = order[start:start + 32]
            batch.update(zip(chunk, run(llm, [(prompts[i], sampling, 0) for i in chunk]), strict=True))
        continuation_wrong: dict[int, list[int]] = {}
        for i, prompt in prompts.items():
            ks = range(1, args.max_tokens)
            rests = run(llm, [(prompt + alone[i][:k], dataclasses.replace(sampling, max_tokens=args.max_tokens - k), k)
                              for k in ks])
            wrong = [k for k, rest in zip(ks, rests, strict=True) if rest != alone[i][k:]]
            if wrong:
                continuation_wrong[i] = wrong
    batch_wrong = [i for i in order if batch[i] != alone[i]]
    result = {"model": args.model, "num_requests": len(prompts), "max_tokens": args.max_tokens,
              "batch32_differs": len(batch_wrong), "batch32_requests": batch_wrong[:20],
              "continuation_differs": len(continuation_wrong),
              "continuation_requests": {str(i): ks for i, ks in list(continuation_wrong.items())[:20]}}
    print(result)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
