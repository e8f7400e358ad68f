"""vLLM's offline beam search over given token prompts, for `benchmarks.beam_search --vs-vllm`.

Runs in vLLM's own venv (.venv-vllm, benchmarks/vllm_peer.py), so it imports nothing of Pagoda:
    .venv-vllm/bin/python benchmarks/beam_search_peer.py IN.json OUT.json
IN: {"model", "dtype", "prompts": [[ids]], "beam_width", "max_tokens"}; OUT: {"seconds", "beams"}.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM
    from vllm.sampling_params import BeamSearchParams

    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=2048, enforce_eager=False)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    params = BeamSearchParams(beam_width=job["beam_width"], max_tokens=job["max_tokens"])
    llm.beam_search(prompts[:1], params)  # warm-up, as the Pagoda side gets
    started = time.perf_counter()
    outputs = llm.beam_search(prompts, params)
    seconds = time.perf_counter() - started
    beams = [[seq.tokens[len(p):] for seq in out.sequences] for p, out in zip(job["prompts"], outputs, strict=True)]
    json.dump({"seconds": seconds, "beams": beams}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
