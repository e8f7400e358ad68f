"""The gateway over real worker + scheduler processes, driven by the real `openai` client."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest

from pagoda.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.conftest import ENGINE_WORKER_FLAGS, ServiceProcess, free_port
from tests.e2e.gateway_conftest import wait_for

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Tell me about the river."}]
PROMPT = "The river flows"


@pytest.fixture(scope="module")
def client(gateway_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_stack.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(gateway_stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway_stack.http_url}/v1", api_key="unused", max_retries=0)


def greedy(client, max_tokens: int = 24) -> str:
    reply = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                      max_tokens=max_tokens, temperature=0)
    return reply.choices[0].text


def test_models_lists_the_model_path(client, gateway_stack):
    assert [m.id for m in client.models.list().data] == [gateway_stack.model_dir]


def test_greedy_completion_equals_the_offline_llm(client, gateway_stack):
    from pagoda.contract.params import SamplingParams
    from pagoda.entrypoints.llm import LLM

    offline = LLM(model=gateway_stack.model_dir, device=ENGINE_WORKER_FLAGS["device"],
                  dtype=ENGINE_WORKER_FLAGS["dtype"])
    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    assert expected and greedy(client) == expected


def test_sync_chat_and_streamed_completion_agree_on_greedy_text(client, gateway_stack):
    chat = client.chat.completions.create(model=gateway_stack.model_dir, messages=CHAT, max_tokens=12,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"
    stream = client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=24,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy(client)
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.total_tokens > 24


def test_stop_string_trims_and_finishes(client, gateway_stack):
    text = greedy(client)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    reply = client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=24,
                                      temperature=0, stop=[stop])
    assert reply.choices[0].text == text[:text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_n2_and_seeded_sampling_repeats(client, gateway_stack):
    def sample() -> list[str]:
        reply = client.chat.completions.create(model=gateway_stack.model_dir, messages=CHAT, n=2,
                                               max_tokens=10, temperature=1.0, seed=1234)
        assert [c.index for c in reply.choices] == [0, 1]
        return [c.message.content for c in reply.choices]

    first = sample()
    assert first == sample()
    assert first[0] != first[1]  # each sequence has its own randomness


def test_logprobs_chat_and_completions(client, gateway_stack):
    chat = client.chat.completions.create(model=gateway_stack.model_dir, messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy: the best token was chosen
    completion = client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=4,
                                           temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and logprobs.text_offset[0] == 0


async def test_async_client_streams_chat(async_client, gateway_stack):
    stream = await async_client.chat.completions.create(
        model=gateway_stack.model_dir, messages=CHAT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = await async_client.chat.completions.create(model=gateway_stack.model_dir, messages=CHAT,
                                                       max_tokens=8, temperature=0)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_errors_through_the_openai_client(client, gateway_stack):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    max_model_len = httpx.get(f"{gateway_stack.http_url}/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {max_model_len} tokens"):
        client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=max_model_len)


async def _scheduler_stats(target: str) -> engine_pb2.EngineStats:
    async with grpc.aio.insecure_channel(target) as channel:
        return await engine_pb2_grpc.EngineStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=5)


def test_disconnect_mid_stream_frees_every_block(gateway_stack):
    before = asyncio.run(_scheduler_stats(gateway_stack.scheduler_target))
    body = {"model": gateway_stack.model_dir, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gateway_stack.http_url}/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The connection is closed: the gateway cancels Generate and the scheduler frees the blocks.
    def scheduler_idle() -> bool:
        nonlocal stats
        stats = asyncio.run(_scheduler_stats(gateway_stack.scheduler_target))
        return stats.idle and stats.num_used_blocks == 0

    stats = None
    wait_for(scheduler_idle)
    assert stats.invariant_ok and stats.generation_tokens - before.generation_tokens < 400


async def test_public_grpc_streams_and_reflects(gateway_stack, client):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from pagoda.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerationRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams(
        temperature=0, max_tokens=24))
    async with grpc.aio.insecure_channel(gateway_stack.grpc_target) as channel:
        chunks = [c async for c in gateway_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)]
        listing = [r async for r in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
    assert "".join(c.text for c in chunks) == await asyncio.to_thread(greedy, client)
    assert sum(len(c.token_ids) for c in chunks) == 24 == chunks[-1].usage.completion_tokens
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    names = {s.name for s in listing[0].list_services_response.service}
    assert {"pagoda.v1.Generation", "grpc.health.v1.Health"} <= names


def test_a_gateway_whose_tokenizer_cannot_load_exits_and_says_why(gateway_stack, tmp_path):
    """Never ready, it must not sit there answering 503 forever: it exits non-zero with the reason."""
    missing = tmp_path / "no-such-model"
    gateway = ServiceProcess("gateway-bad-tokenizer", "gateway", [
        "--scheduler", gateway_stack.scheduler_target, "--port", str(free_port()),
        "--grpc-port", str(free_port()), "--tokenizer", str(missing)], 0, tmp_path)
    try:
        assert gateway.proc.wait(timeout=60) == 1
    finally:
        gateway.stop()
    assert "gateway_connect_failed" in gateway.log_tail() and str(missing) in gateway.log_tail()


async def test_penalties_and_min_tokens_work_through_the_services(async_client, client, gateway_stack):
    """Each of these once made the worker's step fail (in-place edits of inference-mode logits), and
    the scheduler recomputed the same batch forever, starving the greedy request sent with it."""
    expected = await asyncio.to_thread(greedy, client)
    model = gateway_stack.model_dir
    variants = [dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                dict(extra_body={"repetition_penalty": 1.3}), dict(extra_body={"min_tokens": 8}),
                dict(presence_penalty=1.0, frequency_penalty=1.0, seed=7, temperature=0.9,
                     extra_body={"repetition_penalty": 1.1, "top_k": 20, "min_p": 0.05})]
    calls = [async_client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                             **{"temperature": 0, **variant}) for variant in variants]
    calls.append(async_client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0))
    *penalised, plain = await asyncio.gather(*calls)
    assert plain.choices[0].text == expected
    for reply in penalised:
        assert reply.usage.completion_tokens >= 8 or reply.choices[0].finish_reason == "stop"
    assert penalised[3].usage.completion_tokens >= 8  # min_tokens


def test_echo_with_logprobs_scores_the_prompt_as_the_offline_llm(client, gateway_stack):
    from pagoda.contract.params import SamplingParams
    from pagoda.entrypoints.llm import LLM

    offline = LLM(model=gateway_stack.model_dir, device=ENGINE_WORKER_FLAGS["device"],
                  dtype=ENGINE_WORKER_FLAGS["dtype"])
    expected = offline.generate([PROMPT], SamplingParams(prompt_logprobs=2, max_tokens=1), use_tqdm=False)[0]
    num_prompt = len(expected.prompt_token_ids)
    for _ in range(2):  # the second time its blocks are cached: the logprobs must not be lost
        reply = client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=3,
                                          temperature=0, echo=True, logprobs=2)
        choice = reply.choices[0]
        assert choice.text.startswith(PROMPT) and len(choice.logprobs.tokens) == num_prompt + 3
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        for got, want in zip(choice.logprobs.token_logprobs[1:num_prompt], expected.prompt_logprobs[1:],
                             strict=True):
            assert abs(got - want.logprob) < 1e-4
        assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:])
    stream = client.completions.create(model=gateway_stack.model_dir, prompt=PROMPT, max_tokens=3,
                                       temperature=0, echo=True, logprobs=1, stream=True)
    first = next(iter(stream)).choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs.token_logprobs[0] is None
    assert abs(first.logprobs.token_logprobs[1] - expected.prompt_logprobs[1].logprob) < 1e-4
    chat = client.chat.completions.create(model=gateway_stack.model_dir, messages=CHAT, max_tokens=2,
                                          extra_body={"prompt_logprobs": 1})
    prompt_logprobs = chat.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == chat.usage.prompt_tokens
    assert all(entry["logprob"] <= 0 and entry["rank"] >= 1 for pos in prompt_logprobs[1:] for entry in pos.values())
