"""Issue 23 on the real default model (SmolLM2-135M-Instruct) through real worker, scheduler and
gateway processes, asked by the real `openai` client: logit_bias, allowed_token_ids, bad_words,
batch prompts (structured outputs: test_structured_outputs_e2e.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smollm2_api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2_api}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def tokenize(http_url: str, text: str) -> list[int]:
    return httpx.post(f"{http_url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                      timeout=10).json()["tokens"]


def test_logit_bias_removes_and_forces_the_greedy_token(client, model, smollm2_api):
    def first_token(**kwargs) -> int:
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, **kwargs)
        return tokenize(smollm2_api, reply.choices[0].text)[0]

    greedy_id = first_token()
    runner_up = first_token(logit_bias={str(greedy_id): -100})
    assert runner_up != greedy_id
    forced = tokenize(smollm2_api, " Berlin")[0]
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                      logit_bias={str(forced): 100})
    assert tokenize(smollm2_api, reply.choices[0].text) == [forced] * 3
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0,
                                          logit_bias={str(forced): 100})
    assert tokenize(smollm2_api, chat.choices[0].message.content) == [forced] * 3


def test_bad_words_and_allowed_token_ids(client, model, smollm2_api):
    plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    assert "Paris" in plain.choices[0].message.content
    banned = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0,
                                            extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].message.content
    allowed_ids = tokenize(smollm2_api, " yes no")
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0.8, seed=1,
                                      extra_body={"allowed_token_ids": allowed_ids})
    assert set(reply.choices[0].text.split()) <= {"yes", "no"}


def test_bad_logit_bias_is_400(client, model):
    for bias in ({"5": 101}, {"99999999": 1}, {"x": 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=1, logit_bias=bias)


def test_batch_prompts_equal_their_single_prompt_answers(client, model):
    prompts = [PROMPT, "The largest planet is", "Water boils at"]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [s for s in singles for _ in range(2)]
    assert 6 <= batch.usage.completion_tokens <= 6 * 8
    stream = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    texts = ["", "", ""]
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == singles and usage.prompt_tokens > 3
