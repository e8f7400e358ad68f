"""An `LLM` with tensor parallelism releases its follower processes and its group when it is
garbage-collected, as vLLM's users expect from `del llm` (its own module: the TP parity module
keeps a TP=2 engine alive for all of its tests, and a process holds one group at a time)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.worker.test_tp_parity import ENGINE


@pytest.mark.slow
def test_del_then_a_new_tp2_llm_in_the_same_process(tiny_model_dir: str) -> None:
    """vLLM's users `del` their engine: that alone must release the TP group and its followers."""
    import gc
    import os

    llm = LLM(model=tiny_model_dir, tensor_parallel_size=2, **ENGINE)
    [pid] = llm.runner.follower_pids
    del llm
    gc.collect()
    with pytest.raises(ProcessLookupError):  # the follower was stopped and reaped
        os.kill(pid, 0)
    again = LLM(model=tiny_model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        out = again.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=3),
                             use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        again.close()
