"""Embeddings on the worker (worker_svc/pooling.py): the pooled vector equals HF transformers' final
(normed) hidden states of the prompt, last position or mean, whole prompt or chunked prefill, next
to a generating request in the same batch."""

from __future__ import annotations

import pytest
import torch

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import NewRequestData, StepPlan
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import ModelRunner

BLOCK_SIZE = 4
POOLING = SamplingParams(temperature=0.0, max_tokens=1, pooling=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [1, 17, 33, 49, 65, 81, 97, 5, 9, 200, 3]  # 11 tokens: 3 blocks


@pytest.fixture(scope="module")
def hf_hidden(tiny_model_dir: str) -> torch.Tensor:
    """[len(PROMPT), hidden]: HF's last_hidden_state (after the final norm), fp32."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).last_hidden_state[0]


def make_runner(model_dir: str, pooling_type: str, normalize: bool = True) -> ModelRunner:
    config = WorkerConfig(model=model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                          num_gpu_blocks_override=16, pooling_type=pooling_type, normalize_embeddings=normalize)
    runner = ModelRunner(config, max_num_batched_tokens=64)
    runner.initialize()
    return runner


def new(rid: str, tokens: list[int], blocks: list[int], scheduled: int, sampling: SamplingParams) -> NewRequestData:
    return NewRequestData(RequestId(rid), list(tokens), len(tokens), blocks, 0, scheduled, sampling)


def expected(hf_hidden: torch.Tensor, pooling_type: str, normalize: bool) -> torch.Tensor:
    vector = hf_hidden[-1] if pooling_type == "last" else hf_hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_whole_prompt_matches_hf(tiny_model_dir, hf_hidden, pooling_type, normalize) -> None:
    runner = make_runner(tiny_model_dir, pooling_type, normalize)
    result = runner.execute(StepPlan(step_id=1, new_requests=[new("e", PROMPT, [0, 1, 2], len(PROMPT), POOLING)]))
    [embedding] = result.embeddings
    assert embedding.request_id == "e" and result.request_ids == ["e"]  # its one (unread) token
    torch.testing.assert_close(torch.tensor(embedding.values), expected(hf_hidden, pooling_type, normalize),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_chunked_prefill_next_to_a_generating_request(tiny_model_dir, hf_hidden, pooling_type) -> None:
    """Chunks of 4, 5 and 2 tokens: only the last reports, and the mean counts every chunk once."""
    runner = make_runner(tiny_model_dir, pooling_type, normalize=False)
    e, g = RequestId("e"), RequestId("g")
    first = runner.execute(StepPlan(step_id=1, new_requests=[
        new("g", [1, 7, 8], [5, 6], 3, GREEDY), new("e", PROMPT, [0, 1, 2], 4, POOLING)]))
    assert first.embeddings == [] and first.request_ids == [g]
    second = runner.execute(StepPlan(step_id=2, num_scheduled_tokens={e: 5}))
    assert second.embeddings == [] and second.request_ids == [g]
    third = runner.execute(StepPlan(step_id=3, num_scheduled_tokens={e: 2}))
    [embedding] = third.embeddings
    assert set(third.request_ids) == {e, g}
    torch.testing.assert_close(torch.tensor(embedding.values), expected(hf_hidden, pooling_type, False),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_the_offline_llm_embeds_as_hf_does(tiny_model_dir, hf_hidden, pooling_type) -> None:
    """`LLM.embed`: the same vector, whole prompt or prefilled 4 tokens at a time, in input order."""
    from pagoda import LLM

    other = [7, 8, 9, 10, 11]
    with LLM(model=tiny_model_dir, dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks_override=16,
             max_num_batched_tokens=4, pooling_type=pooling_type) as llm:
        outputs = llm.embed([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": other}], use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == [PROMPT, other] and all(o.finished for o in outputs)
        torch.testing.assert_close(torch.tensor(outputs[0].outputs.embedding),
                                   expected(hf_hidden, pooling_type, True), atol=1e-4, rtol=1e-4)
        again = llm.embed({"prompt_token_ids": PROMPT}, use_tqdm=False)[0].outputs.embedding
        assert again == outputs[0].outputs.embedding  # a prefix-cache hit is never taken for pooling
        with pytest.raises(ValueError, match="empty"):
            llm.embed({"prompt_token_ids": []})
        llm.scheduler.check_invariants()
