"""n-gram speculative decoding against plain decoding, same model, same prompts, interleaved runs.

    python -m benchmarks.spec_decode [--model models/smollm2-135m-instruct] [--k 4]
    python -m benchmarks.spec_decode --workload tool-output [--k 8] [--requests 32]

Two workloads, greedy, prefix caching off (every run computes the same thing):
- copy-heavy: chat prompts asking the model to repeat a passage that is in the prompt (what RAG,
  summaries and code edits look like to prompt lookup), at batch 1 and batch 8; each answer ends
  where the model ends it (EOS, or the --max-tokens cap); `--ignore-eos` forces --max-tokens
  tokens, i.e. also what the model makes up once the passage is done;
- ShareGPT-like (`ignore_eos`): random-token prompts with lognormal lengths
  (benchmarks/datasets.py), where lookups should mostly miss (on this model they do not: it falls
  into repeating itself);
- chat, new text: "explain X in a few sentences" answers (up to 64 tokens, EOS), where little of
  the answer is in the prompt: the miss case, where speculation must not cost much.
Per-request decode tokens/s: each request's tokens after its first over the time from its first
token to its last (1 / its TPOT, from `RequestOutput.metrics`), averaged over the batch. Also
printed, the batch-completion rate: (longest output - 1) / (time of the full run - time of a
1-token run of the same batch), i.e. the slowest request's, which at batch > 1 speculation moves
only as far as the request that copies worst. Best of `--repeats` interleaved off/on runs;
ShareGPT-like and chat (whole-batch rows, best of `--whole-batch-repeats`) report output tokens/s
of the whole batch; each row's JSON also has every interleaved pair's ratio (one run's noise).
Also checks that greedy outputs are identical with and without.
Prints a table and writes benchmarks/results/spec_decode.json.

`--workload tool-output` (suffix decoding's case) runs only this: one ~300-token JSON tool result
quoted by `--requests` chat requests that each ask, in their own words, to repeat it or extract a
part of it; greedy, batch 1 (one request at a time, in order, each answer ending where the model
ends it), through three engines: no speculation, ngram and suffix, both at K = `--k`. Requests run
interleaved (request i on every engine, then i + 1), so drift hits all alike; suffix decoding's
cache holds the earlier requests' answers by the time a later one runs, which is the point. Prints
each engine's per-request decode tok/s (mean over the requests, as above), acceptance, and whether
the outputs are identical; writes benchmarks/results/spec_decode_tool_output.json.

`--workload draft` (draft-model speculation): fresh text, where n-gram lookup has nothing to copy:
`--requests` chat answers ("explain X") and as many code answers ("write a function that..."),
`--max-tokens` each, EOS ignored, greedy, one request at a time (interleaved over the engines) and
then the whole batch at each of `--batch-sizes`, through: no speculation, ngram k, and each draft of
`--drafts` at k (default self:q4: the target's own weights in int4). Prints per-request decode
tok/s, whole-batch output tok/s, acceptance, identical outputs; writes
benchmarks/results/spec_decode_draft.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.datasets import WorkloadSpec, make_workload
from benchmarks.kv_cache_fp8 import chat_prompts
from benchmarks.result_file import write_result
from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from pagoda.tools.default_model import DEFAULT_OUT

PASSAGES = [
    "PagedAttention stores the key and value cache in fixed-size blocks. Each request keeps a page "
    "table that maps its logical blocks to physical ones, so memory is allocated on demand and "
    "shared between requests that start with the same prompt.",
    "The scheduler runs every iteration. It decides which requests compute how many tokens, admits "
    "waiting requests while the token budget and the block pool allow, and preempts the newest "
    "request when the pool runs out of free blocks.",
    "To bake the bread, mix the flour, water, salt and yeast, knead the dough for ten minutes, let it "
    "rise for two hours, shape it into a loaf, and bake it at two hundred and twenty degrees for "
    "forty minutes until the crust is brown.",
    "The meeting is moved to Thursday at three o'clock in the large conference room on the second "
    "floor. Please bring the quarterly report, the updated budget and your questions about the new "
    "hiring plan for the engineering team.",
    "def add_request(self, request):\n    if request.request_id in self.requests:\n        raise "
    "ValueError('duplicate request id')\n    self.requests[request.request_id] = request\n    "
    "self.waiting.append(request)\n    return request.request_id\n",
    "Continuous batching lets new requests join a running batch at any step, and finished requests "
    "leave it at once. The GPU stays busy, and a short request never waits for a long one that "
    "happened to arrive just before it.",
    "Our return policy is simple: items can be returned within thirty days of delivery for a full "
    "refund, as long as they are unused and in their original packaging. Shipping costs for returns "
    "are covered by the customer.",
    "The river flows from the mountains in the north through three valleys and two large lakes "
    "before it reaches the sea. Its water feeds the farms along its banks and the cities that grew "
    "up where it meets the coast.",
]


TOOL_RESULT = {
    "order_id": "A-20931", "status": "shipped", "placed_at": "2026-11-02T14:31:08Z",
    "customer": {"name": "Maria Lopez", "email": "maria.lopez@example.com", "tier": "gold"},
    "shipping": {"carrier": "DHL Express", "tracking_number": "JD014600006281720395",
                 "address": {"street": "Calle Mayor 12, 3B", "city": "Madrid", "postal_code": "28013",
                             "country": "ES"},
                 "estimated_delivery": "2026-11-06"},
    "items": [{"sku": "KB-7781", "name": "Mechanical keyboard, brown switches", "quantity": 1, "price": 89.9},
              {"sku": "MS-1204", "name": "Wireless mouse", "quantity": 2, "price": 24.5},
              {"sku": "CB-0033", "name": "USB-C cable, 2 m", "quantity": 3, "price": 7.99}],
    "totals": {"subtotal": 162.87, "shipping": 0.0, "tax": 34.2, "total": 197.07, "currency": "EUR"},
}

TOOL_ASKS = [
    "Repeat the tool output above exactly, as JSON.",
    "Copy the JSON returned by the tool, unchanged.",
    "Show me the raw tool result.",
    "Return the tool's JSON verbatim so I can paste it into my ticket.",
    "Print the order JSON exactly as the tool gave it.",
    "What did the tool return? Quote it in full.",
    "Echo the tool response back to me.",
    "Reproduce the JSON result without changing anything.",
    "Give me the shipping object from the tool output, as JSON.",
    "Extract the items array from the tool result, exactly as JSON.",
    "Extract the totals object from the tool result.",
    "Extract the customer object from the JSON above.",
    "Paste the full tool output in a code block.",
    "I need the exact JSON for my records. Repeat it.",
    "Please output the tool result again, word for word.",
    "Show the order details JSON exactly as received.",
]


def tool_output_prompts(tokenizer, n: int) -> list[dict]:
    """`n` requests quoting the same tool result, each asking in its own words (TOOL_ASKS, then the
    same asks with a request number, so no two prompts are the same)."""
    import json

    quoted = "The tool get_order_status returned:\n```json\n" + json.dumps(TOOL_RESULT) + "\n```\n\n"
    prompts = []
    for i in range(n):
        ask = TOOL_ASKS[i % len(TOOL_ASKS)]
        if i >= len(TOOL_ASKS):
            ask = f"(request {i}) {ask}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": quoted + ask}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append({"prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)})
    return prompts


def tool_output(args: argparse.Namespace) -> dict:
    """The tool-output workload: off / ngram / suffix at batch 1 (see the module docstring)."""
    common = dict(dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=2048)
    specs = {"off": None,
             f"ngram k={args.k}": {"method": "ngram", "num_speculative_tokens": args.k,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2},
             f"suffix k={args.k}": {"method": "suffix", "num_speculative_tokens": args.k}}
    engines = {name: LLM(args.model, speculative_config=spec, **common) for name, spec in specs.items()}
    tokenizer = engines["off"].tokenizer
    for llm in engines.values():  # (not the JSON: suffix decoding's cache starts without it)
        timed(llm, copy_prompts(tokenizer, 2), 8)
    prompts = tool_output_prompts(tokenizer, args.requests)
    before = {name: counters(llm) for name, llm in engines.items()}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for i, prompt in enumerate(prompts):
        for name, llm in engines.items():  # interleaved: drift hits every engine alike
            _, out, rate = timed(llm, [prompt], args.tool_max_tokens, ignore_eos=False)
            rates[name].append(rate)
            outputs[name] += out
        # one line a request: a long run that is stopped still leaves its figures so far
        print(f"request {i}: {len(outputs['off'][-1])} tokens; decode tok/s "
              + ", ".join(f"{name} {r[-1]:.1f}" for name, r in rates.items()), flush=True)
    off = statistics.fmean(rates["off"])
    results = {"model": args.model, "dtype": args.dtype, "k": args.k, "requests": args.requests,
               "prompt_tokens": statistics.fmean(len(p["prompt_token_ids"]) for p in prompts),
               "max_tokens": args.tool_max_tokens,
               "mean_output_tokens": statistics.fmean(map(len, outputs["off"]))}
    print(f"\ntool-output workload: {args.requests} requests quoting one JSON tool result "
          f"({results['prompt_tokens']:.0f} prompt tokens on average), batch 1, greedy, {args.model}, {args.dtype}")
    print(f"mean output {results['mean_output_tokens']:.0f} tokens (max {args.tool_max_tokens})")
    print(f"{'engine':<14}{'decode tok/s':>14}{'vs off':>8}{'accept':>9}{'acc/step':>10}  identical"
          f"  (per request: first 8 / last 8 requests)")
    for name in engines:
        rate = statistics.fmean(rates[name])
        acc = acceptance(engines[name], before[name])
        same = outputs[name] == outputs["off"]
        half = max(1, min(8, len(rates[name]) // 2))
        early, late = statistics.fmean(rates[name][:half]), statistics.fmean(rates[name][-half:])
        results[name] = {"decode_tok_s_per_request": round(rate, 1), "speedup": round(rate / off, 2),
                         "first_requests_tok_s": round(early, 1), "last_requests_tok_s": round(late, 1),
                         "identical_outputs": same, **acc}
        accept = acc["acceptance_rate"]
        per_step = acc["mean_accepted_per_draft_step"]
        print(f"{name:<14}{rate:>14.1f}{rate / off:>7.2f}x{'' if accept is None else f'{accept:.0%}':>9}"
              f"{'' if per_step is None else f'{per_step:.2f}':>10}  {str(same):<9}  {early:.1f} / {late:.1f}")
    for llm in engines.values():
        llm.close()
    write_result(args.out.replace("spec_decode.json", "spec_decode_tool_output.json"), results)
    return results


CODE_ASKS = ["Write a Python function that checks whether a string is a palindrome.",
             "Write a Python function that merges two sorted lists.",
             "Write a JavaScript function that debounces another function.",
             "Write a Python class for a stack with push, pop and peek.",
             "Write a SQL query that returns the ten customers with the highest total order value.",
             "Write a Python function that counts the words in a text file.",
             "Write a Rust function that reverses a vector in place.",
             "Write a Python generator that yields the Fibonacci numbers."]


def draft_workload(args: argparse.Namespace) -> dict:
    """Draft-model speculation against none and ngram on fresh text (see the module docstring)."""
    common = dict(dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=2048)
    specs = {"off": None, f"ngram k={args.k}": {"method": "ngram", "num_speculative_tokens": args.k}}
    specs.update({f"{d} k={args.k}": {"model": d, "num_speculative_tokens": args.k} for d in args.drafts})
    engines = {name: LLM(args.model, speculative_config=spec, **common) for name, spec in specs.items()}
    tok = engines["off"].tokenizer
    chats = chat_prompts(tok, args.requests)
    code = [{"prompt_token_ids": list(_ids(tok.apply_chat_template(
        [{"role": "user", "content": CODE_ASKS[i % len(CODE_ASKS)]}], add_generation_prompt=True, tokenize=True)))}
        for i in range(args.requests)]
    for llm in engines.values():
        timed(llm, chats[:1], 8)
    results: dict = {"model": args.model, "dtype": args.dtype, "k": args.k, "max_tokens": args.max_tokens,
                     "requests": args.requests}
    print(f"draft-model speculation, {args.model}, {args.dtype}, greedy, EOS ignored, {args.max_tokens} tokens")
    print(f"{'workload':<22}{'engine':<28}{'tok/s':>9}{'vs off':>8}{'accept':>9}  identical")
    for label, prompts in (("chat", chats), ("code", code)):
        rows = [(f"{label}, batch 1", [[p] for p in prompts], "decode tok/s per request")]
        rows += [(f"{label}, batch {b}", [prompts[:b]], "output tok/s") for b in args.batch_sizes if b > 1]
        for name, batches, unit in rows:
            before = {e: counters(llm) for e, llm in engines.items()}
            rates: dict[str, list[float]] = {e: [] for e in engines}
            outs: dict[str, list] = {e: [] for e in engines}
            for batch in batches:
                for e, llm in engines.items():  # interleaved: drift hits every engine alike
                    seconds, out, rate = timed(llm, batch, args.max_tokens)
                    rates[e].append(rate if len(batch) == 1 else sum(map(len, out)) / seconds)
                    outs[e] += out
            off = statistics.fmean(rates["off"])
            results[name] = {"unit": unit}
            for e in engines:
                rate, acc = statistics.fmean(rates[e]), acceptance(engines[e], before[e])
                same = outs[e] == outs["off"]
                results[name][e] = {"tok_s": round(rate, 2), "ratio": round(rate / off, 2), "identical": same, **acc}
                accept = acc["acceptance_rate"]
                print(f"{name:<22}{e:<28}{rate:>9.1f}{rate / off:>7.2f}x"
                      f"{'' if accept is None else f'{accept:.0%}':>9}  {same}", flush=True)
    for llm in engines.values():
        llm.close()
    write_result(args.out.replace("spec_decode.json", "spec_decode_draft.json"), results)
    return results


def _ids(ids) -> list[int]:
    return ids["input_ids"] if hasattr(ids, "keys") else ids


def copy_prompts(tokenizer, batch: int) -> list[dict]:
    prompts = []
    for i in range(batch):
        messages = [{"role": "user", "content": "Repeat the following passage exactly, word for word:\n\n"
                     + PASSAGES[i % len(PASSAGES)]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        prompts.append({"prompt_token_ids": list(ids)})
    return prompts


def timed(llm: LLM, prompts: list[dict], max_tokens: int | list[int],
          ignore_eos: bool = True) -> tuple[float, list[list[int]], float]:
    """(seconds, outputs, mean per-request decode tok/s: each request's own tokens after its first
    over the time from its first token to its last, i.e. 1 / its TPOT)."""
    lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for n in lens]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    rates = [(len(o.outputs[0].token_ids) - 1) / (o.metrics.finished_time - o.metrics.first_token_time)
             for o in outputs if len(o.outputs[0].token_ids) > 1]
    return seconds, [o.outputs[0].token_ids for o in outputs], statistics.fmean(rates) if rates else 0.0


def measure(engines: dict[str, LLM], prompts: list[dict], max_tokens, repeats: int, *, decode_only: bool,
            ignore_eos: bool = True, runs: dict[str, list[float]] | None = None):
    """{engine: (best seconds, outputs, its per-request decode tok/s)}; decode_only subtracts a
    1-token run (the prefill) from the seconds. `runs`, if given, gets every run's seconds per engine
    (their spread says how far one run's noise could move the ratio)."""
    best: dict[str, tuple[float, list, float]] = {}
    for _ in range(repeats):
        for name, llm in engines.items():  # interleaved: drift hits both alike
            seconds, outputs, rate = timed(llm, prompts, max_tokens, ignore_eos)
            if decode_only:
                seconds -= timed(llm, prompts, 1)[0]
            if runs is not None:
                runs.setdefault(name, []).append(seconds)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, outputs, rate)
    return best


def pair_ratios(runs: dict[str, list[float]], on_name: str) -> list[float]:
    """Each interleaved pair's on/off speed ratio (off seconds / on seconds), in run order."""
    return [round(off / on, 3) for off, on in zip(runs["off"], runs[on_name], strict=True)]


def acceptance(llm: LLM, before: tuple[int, int, int]) -> dict:
    core = llm.scheduler
    drafts = core.spec_num_drafts - before[0]
    proposed = core.spec_num_draft_tokens - before[1]
    accepted = core.spec_num_accepted_tokens - before[2]
    return {"draft_steps": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "mean_accepted_per_draft_step": round(accepted / drafts, 2) if drafts else None}


def counters(llm: LLM) -> tuple[int, int, int]:
    core = llm.scheduler
    return core.spec_num_drafts, core.spec_num_draft_tokens, core.spec_num_accepted_tokens


def whole_batch_row(engines: dict[str, LLM], args: argparse.Namespace, prompts: list[dict], max_tokens,
                    ignore_eos: bool, key: str, label: str, results: dict, rows: list) -> None:
    """Output tokens/s of the whole batch, off and on (a workload measured end to end)."""
    on_name = f"ngram k={args.k}"
    before = counters(engines[on_name])
    runs: dict[str, list[float]] = {}
    best = measure(engines, prompts, max_tokens, args.whole_batch_repeats, decode_only=False,
                   ignore_eos=ignore_eos, runs=runs)
    tps = {name: sum(map(len, outputs)) / seconds for name, (seconds, outputs, _) in best.items()}
    same = best["off"][1] == best[on_name][1]
    results[key] = {"output_tok_s_off": round(tps["off"], 1), "output_tok_s_on": round(tps[on_name], 1),
                    "ratio": round(tps[on_name] / tps["off"], 3), "identical_outputs": same,
                    "repeats": args.whole_batch_repeats, "pair_ratios": pair_ratios(runs, on_name),
                    **acceptance(engines[on_name], before)}
    rows.append((label, tps["off"], tps[on_name], same, results[key]))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.workload == "tool-output":
        return tool_output(args)
    if args.workload == "draft":
        return draft_workload(args)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    common = dict(dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=2048)
    engines = {"off": LLM(args.model, **common), f"ngram k={args.k}": LLM(args.model, speculative_config=spec,
                                                                          **common)}
    on = engines[f"ngram k={args.k}"]
    warm = copy_prompts(on.tokenizer, 2)
    for llm in engines.values():
        timed(llm, warm, 8)
    rows, results = [], {"model": args.model, "dtype": args.dtype, "k": args.k, "max_tokens": args.max_tokens,
                         "copy_ignore_eos": args.ignore_eos}
    for batch in args.batch_sizes:
        prompts = copy_prompts(on.tokenizer, batch)
        before = counters(on)
        runs: dict[str, list[float]] = {}
        best = measure(engines, prompts, args.max_tokens, args.repeats, decode_only=True,
                       ignore_eos=args.ignore_eos, runs=runs)
        # the batch's: the longest output over the whole run's decode time (the slowest request's)
        batch_tps = {name: (max(map(len, outputs)) - 1) / seconds for name, (seconds, outputs, _) in best.items()}
        off_tps, on_tps = best["off"][2], best[f"ngram k={args.k}"][2]
        same = best["off"][1] == best[f"ngram k={args.k}"][1]
        off_batch, on_batch = batch_tps["off"], batch_tps[f"ngram k={args.k}"]
        results[f"copy_batch{batch}"] = {"decode_tok_s_per_request_off": round(off_tps, 1),
                                         "decode_tok_s_per_request_on": round(on_tps, 1),
                                         "speedup": round(on_tps / off_tps, 2),
                                         "batch_decode_tok_s_off": round(off_batch, 1),
                                         "batch_decode_tok_s_on": round(on_batch, 1),
                                         "batch_speedup": round(on_batch / off_batch, 2),
                                         "identical_outputs": same, "repeats": args.repeats,
                                         "batch_pair_ratios": pair_ratios(runs, f"ngram k={args.k}"),
                                         "mean_output_tokens": statistics.fmean(map(len, best["off"][1])),
                                         **acceptance(on, before)}
        rows.append((f"copy-heavy, batch {batch}", off_tps, on_tps, same, results[f"copy_batch{batch}"]))
        rows.append((f"  (batch completion, {batch})", off_batch, on_batch, same, {"acceptance_rate": None}))
        print(f"copy-heavy, batch {batch}: per request {off_tps:.1f} -> {on_tps:.1f} tok/s "
              f"({on_tps / off_tps:.2f}x), identical {same}", flush=True)  # a long run's figures so far
    if args.sharegpt_prompts:
        sharegpt_row(engines, args, results, rows)
    # New text: "explain X" chat answers, where little of the answer is in the prompt or in itself.
    prompts = chat_prompts(on.tokenizer, args.chat_prompts)
    whole_batch_row(engines, args, prompts, 64, False, "chat_new_text", f"chat, new text, {len(prompts)}",
                    results, rows)
    print(f"\nn-gram speculative decoding (k={args.k}), {args.model}, {args.dtype}, greedy")
    print(f"{'workload':<28}{'off tok/s':>11}{'on tok/s':>11}{'ratio':>8}{'accept':>9}  identical")
    for name, off_tps, on_tps, same, extra in rows:
        rate = extra["acceptance_rate"]
        print(f"{name:<28}{off_tps:>11.1f}{on_tps:>11.1f}{on_tps / off_tps:>7.2f}x"
              f"{'' if rate is None else f'{rate:.0%}':>9}  {same}")
    write_result(args.out, results)
    return results


def sharegpt_row(engines: dict[str, LLM], args: argparse.Namespace, results: dict, rows: list) -> None:
    work = make_workload(WorkloadSpec("sharegpt-like", num_prompts=args.sharegpt_prompts, vocab_size=49152,
                                      length_scale=args.length_scale, max_model_len=2048, seed=1))
    prompts = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    whole_batch_row(engines, args, prompts, [w.max_tokens for w in work], True, "sharegpt_like",
                    f"ShareGPT-like, {len(work)} prompts", results, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_OUT))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="copy-heavy: the cap (the model stops at EOS once the passage is repeated)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="copy-heavy: generate exactly --max-tokens, past the end of the passage")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--sharegpt-prompts", type=int, default=16, help="0: skip the ShareGPT-like row")
    p.add_argument("--chat-prompts", type=int, default=16, help="the chat (new text) row's requests")
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3, help="copy-heavy rows: interleaved off/on runs, best kept")
    # A quiet chat run is ~3.5 s and its ratio ~1.0 (the longest answer bounds the steps): three
    # runs of the same engine spread by 6% (227-240 tok/s), so a best of 2 let one noisy run decide it
    p.add_argument("--whole-batch-repeats", type=int, default=5,
                   help="chat and ShareGPT-like rows: interleaved off/on runs, best kept")
    p.add_argument("--workload", choices=["all", "tool-output", "draft"], default="all",
                   help="all: the ngram workloads above; tool-output: off / ngram / suffix on a quoted "
                        "tool result; draft: off / ngram / draft models on fresh chat and code text")
    p.add_argument("--drafts", type=lambda s: s.split(","), default=["self:q4"],
                   help="draft workload: draft models (directories, GGUFs, self:q4), comma-separated")
    p.add_argument("--requests", type=int, default=32, help="tool-output: how many requests")
    p.add_argument("--tool-max-tokens", type=int, default=384, help="tool-output: the cap on each answer")
    p.add_argument("--out", default="benchmarks/results/spec_decode.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
