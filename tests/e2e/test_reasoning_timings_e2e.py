"""Reasoning output and request timings through real worker, scheduler and gateway processes, asked
by the real `openai` client: a second gateway with --reasoning-parser deepseek_r1 and
--enable-request-timings over the session's scheduler, checked against the plain gateway."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.e2e.gateway_conftest import start_gateway

CHAT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def timed_url(engine_processes, tmp_path_factory):
    gateway, http_url = start_gateway(engine_processes.scheduler_target, tmp_path_factory.mktemp("gw-reasoning"),
                                      "--reasoning-parser", "deepseek_r1", "--enable-request-timings")
    try:
        yield http_url
    finally:
        gateway.stop()


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_a_reply_without_its_end_tag_is_all_reasoning(gateway_stack, timed_url):
    # The tiny model never writes </think>: for deepseek_r1 (thinking from the first token) its
    # whole greedy reply is reasoning, the plain gateway's content.
    kwargs = {"model": gateway_stack.model_dir, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    plain = client_of(gateway_stack.http_url).chat.completions.create(**kwargs).choices[0].message
    assert "</think>" not in plain.content and not plain.content.lstrip().startswith("<think>")
    reply = client_of(timed_url).chat.completions.create(**kwargs)
    message = reply.choices[0].message
    assert message.reasoning_content == plain.content and message.content is None
    assert reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"
    stream = client_of(timed_url).chat.completions.create(**kwargs, stream=True,
                                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) \
        == plain.content
    assert all(not c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].model_extra["timings"]["predicted_n"] == 12


def test_timings_are_consistent_and_count_the_prefix_hits(gateway_stack, timed_url):
    client = client_of(timed_url)
    prompt = list(range(300, 350))  # 3 full blocks of 16, then 2 tokens
    salt = uuid.uuid4().hex  # a cache of its own: nothing else in the session hits or fills it
    replies = [client.completions.create(model=gateway_stack.model_dir, prompt=prompt, max_tokens=6,
                                         temperature=0, extra_body={"cache_salt": salt}) for _ in range(2)]
    for reply, cached in zip(replies, (0, 48), strict=True):
        t = reply.model_extra["timings"]
        assert reply.usage.prompt_tokens_details.cached_tokens == t["cache_n"] == cached
        assert (t["prompt_n"], t["predicted_n"]) == (50 - cached, 6)
        assert min(t.values()) >= 0 and 0 < t["ttft_ms"] <= t["total_ms"]
        assert t["queue_ms"] + t["prompt_ms"] == pytest.approx(t["ttft_ms"])
        assert t["prompt_ms"] + t["predicted_ms"] <= t["total_ms"] + 1e-6
        assert t["ttft_ms"] + t["predicted_ms"] == pytest.approx(t["total_ms"])
    plain = client_of(gateway_stack.http_url).completions.create(model=gateway_stack.model_dir, prompt=prompt,
                                                                 max_tokens=6, temperature=0)
    assert "timings" not in (plain.model_extra or {})


def test_responses_count_the_reasoning_tokens_and_carry_timings(gateway_stack, timed_url):
    # The tiny model's greedy reply is all thinking for deepseek_r1: every output token is reasoning.
    client = client_of(timed_url)
    kwargs = {"model": gateway_stack.model_dir, "input": "Say hello.", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete" and [item.type for item in whole.output] == ["reasoning"]
    assert whole.usage.output_tokens == whole.usage.output_tokens_details.reasoning_tokens == 12
    assert whole.model_extra["timings"]["predicted_n"] == 12
    final = list(client.responses.create(**kwargs, stream=True))[-1].response  # response.incomplete
    assert final.usage.output_tokens_details.reasoning_tokens == 12 and final.model_extra["timings"]["predicted_n"] == 12
    plain = client_of(gateway_stack.http_url).responses.create(**kwargs)
    assert plain.usage.output_tokens_details.reasoning_tokens == 0 and "timings" not in (plain.model_extra or {})
