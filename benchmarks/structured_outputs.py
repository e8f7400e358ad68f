"""Throughput with a JSON schema on every request vs unconstrained, on the same prompts.

    .venv/bin/python -m benchmarks.structured_outputs [--model models/smollm2-135m-instruct]
        [--num-prompts 32] [--max-tokens 192] [--max-num-seqs 32] [--distinct-schemas]

In-process (`pagoda.LLM`, the same scheduler core, runner and sampler as the services), greedy
unless --temperature, the chat template applied to each prompt. Unconstrained: the model answers freely (EOS or max_tokens).
Constrained: the same prompts, each with `structured_outputs=json` (one schema for all, as an
application sends; --distinct-schemas gives every request its own, so compilation is included).
--same-length ignores EOS, so both runs make the same tokens with the same batch size (the
constrained requests emit EOS after their JSON): the per-token cost of the grammar alone. Prints
output tokens, seconds and output tok/s of each run, their ratio, and how many of the outputs
parse as JSON. Each is run --repeats times, interleaved, and the fastest kept (a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import json
import time

from pagoda import LLM, SamplingParams, StructuredOutputsParams

TOPICS = ["Paris", "the Moon", "a bicycle", "the Amazon river", "jazz", "a volcano", "chess", "coffee",
          "the Roman empire", "honeybees", "a lighthouse", "the Sahara", "origami", "a violin",
          "penguins", "the printing press", "tea", "Mount Everest", "a submarine", "the piano",
          "glaciers", "Tokyo", "a windmill", "the internet", "owls", "a cathedral", "bamboo",
          "the Nile", "a telescope", "tulips", "a marathon", "the Great Wall"]


def schema(variant: int | None = None) -> dict:
    properties = {
        "name": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 200},
        "tags": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 20}},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "facts": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"key": {"type": "string", "maxLength": 20},
                                             "value": {"type": "string", "maxLength": 60}},
            "required": ["key", "value"], "additionalProperties": False}},
    }
    if variant is not None:  # a distinct schema per request: a field of its own
        properties[f"extra_{variant}"] = {"type": "boolean"}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured_outputs",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--distinct-schemas", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (a grammar row is masked only when its argmax is refused); "
                        "> 0: every constrained row is masked before it draws (seeded)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved; the best is kept")
    p.add_argument("--same-length", action="store_true",
                   help="ignore EOS: every request of both runs makes exactly max_tokens tokens (the "
                        "constrained ones EOS after their JSON), so the batch stays the same size")
    return p.parse_args(argv)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[int, float, list[str]]:
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    completions = [o.outputs[0] for o in outputs]
    return sum(len(c.token_ids) for c in completions), seconds, [c.text for c in completions]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    topics = [TOPICS[i % len(TOPICS)] for i in range(args.num_prompts)]
    prompts = [list(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {t} as a JSON object with a name, a summary, tags, "
                                     "a rating and some facts."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)) for t in topics]
    sampling = dict(temperature=args.temperature, seed=0 if args.temperature else None,
                    max_tokens=args.max_tokens, ignore_eos=args.same_length)
    free = SamplingParams(**sampling)

    def constrained(i: int) -> SamplingParams:
        spec = StructuredOutputsParams(json=schema(i if args.distinct_schemas else None))
        return SamplingParams(**sampling, structured_outputs=spec)

    run(llm, prompts[:1], [free])  # warm-ups (the shared schema's compilation is cached here too)
    run(llm, prompts[:1], [constrained(-1)])
    runs = {"unconstrained": [free] * len(prompts),
            "json_schema": [constrained(i) for i in range(len(prompts))]}
    best: dict[str, tuple[int, float, list[str]]] = {}
    for _ in range(args.repeats):  # interleaved, the best of each: a shared machine is noisy
        for name, params in runs.items():
            tokens, seconds, texts = run(llm, prompts, params)
            if name not in best or seconds < best[name][1]:
                best[name] = (tokens, seconds, texts)
    results = {}
    for name, (tokens, seconds, texts) in best.items():
        results[name] = tokens / seconds
        parsed = sum(1 for t in texts if _is_json(t.strip()))
        print(f"{name:>14}: {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s"
              f"  ({parsed}/{len(texts)} outputs parse as JSON; best of {args.repeats})")
    ratio = results["json_schema"] / results["unconstrained"]
    print(f"json_schema / unconstrained output tok/s: {ratio:.2f} ({args.num_prompts} prompts, "
          f"max_tokens {args.max_tokens}, {args.dtype}, temperature {args.temperature}, "
          f"{'a schema per request' if args.distinct_schemas else 'one schema'}"
          f"{', same length (EOS ignored)' if args.same_length else ''})")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
