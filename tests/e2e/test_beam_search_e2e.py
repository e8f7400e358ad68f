"""Beam search through real worker, scheduler and gateway processes, asked by the real `openai`
client with vLLM's `use_beam_search`: the beams equal the offline engine's (whose beams equal HF
transformers': tests/worker/test_beam_search_llm.py), on both endpoints, streamed or not."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_WORKER_FLAGS

pytestmark = pytest.mark.slow
PROMPT = "The river flows"


@pytest.fixture(scope="module")
def client(gateway_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_stack.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(gateway_stack):
    from pagoda.contract.params import SamplingParams
    from pagoda.entrypoints.llm import LLM

    llm = LLM(model=gateway_stack.model_dir, device=ENGINE_WORKER_FLAGS["device"],
              dtype=ENGINE_WORKER_FLAGS["dtype"])

    def beams(prompt_ids: list[int], n: int, width: int, max_tokens: int) -> list[str]:
        params = SamplingParams(n=n, beam_width=width, temperature=0.0, max_tokens=max_tokens)
        return [c.text for c in llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs]

    yield llm, beams
    llm.close()


def test_completions_return_the_engines_beams_best_first(client, gateway_stack, offline):
    llm, beams = offline
    prompt_ids = llm.tokenizer(PROMPT)["input_ids"]
    reply = client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=12, n=2,
                                      extra_body={"use_beam_search": True, "best_of": 4})
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == beams(prompt_ids, 2, 4, 12)
    stream = client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=12, n=2,
                                       stream=True, extra_body={"use_beam_search": True, "best_of": 4})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(reply.choices, key=lambda c: c.index)]


def test_chat_beam_search_equals_the_engines_beams(client, gateway_stack, offline):
    llm, beams = offline
    messages = [{"role": "user", "content": "Tell me about the river."}]
    prompt_ids = httpx.post(f"{gateway_stack.http_url}/tokenize", json={"messages": messages},
                            timeout=10).json()["tokens"]  # the gateway's own chat rendering
    reply = client.chat.completions.create(model=gateway_stack.model_dir, messages=messages, max_tokens=10,
                                           n=3, extra_body={"use_beam_search": True})
    assert [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)] == beams(
        list(prompt_ids), 3, 3, 10)


def test_best_of_without_beam_search_is_a_400(client, gateway_stack):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=4, best_of=2)
    assert "use_beam_search" in str(error.value)
