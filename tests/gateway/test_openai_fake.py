"""The OpenAI routes in-process over the fake engine: shapes, streaming, stop strings, logprobs."""

from __future__ import annotations

import json

from tests.gateway.conftest import SCRIPT_TEXTS, sse_events, wait_until


async def test_completion_returns_script_text_and_usage(gateway, upstream, tokenizer_dir):
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 64})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "text_completion" and body["model"] == tokenizer_dir
    assert body["choices"][0]["text"] == SCRIPT_TEXTS[0]
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt_ids = list(upstream.engine.requests[0].prompt_token_ids)
    num_completion = len(upstream.engine.scripts[0])
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": num_completion,
                             "total_tokens": len(prompt_ids) + num_completion,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_completion_defaults_to_16_tokens_and_chat_to_the_context(gateway, upstream):
    await gateway.http.post("/v1/completions", json={"prompt": "Hi"})
    await gateway.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    completion, chat = upstream.engine.requests
    assert completion.sampling.max_tokens == 16
    assert not chat.sampling.HasField("max_tokens")


async def test_streamed_completion_ends_with_usage_then_done(gateway):
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == SCRIPT_TEXTS[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


async def test_stream_survives_clients_that_split_on_unicode_line_breaks(gateway, upstream, tokenizer):
    # httpx's iter_lines (like str.splitlines) also breaks lines at U+2028/U+2029/U+0085, which JSON
    # may carry raw: the gateway escapes them so every data line stays whole for such clients.
    text = "one\u2028two\u2029three\x85four"
    upstream.engine.scripts = [tokenizer.encode(text, add_special_tokens=False)]
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 64, "stream": True})
    lines = [line for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


async def test_stop_string_trims_text_and_cancels_upstream(gateway, upstream):
    upstream.engine.hold_final_response = True  # the stop string must end it, not the script
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 64,
                                                             "stop": ["end", "zzz"]})
    choice = reply.json()["choices"][0]
    assert choice["text"] == "Hello world. The "
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "end")
    await wait_until(lambda: upstream.engine.cancelled == [upstream.engine.requests[0].request_id])


async def test_streamed_stop_string_included_when_asked(gateway):
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 64, "stop": "end", "include_stop_str_in_output": True, "stream": True})
    chunks = [json.loads(e) for e in sse_events(reply.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world. The end"


async def test_chat_n2_returns_both_sequences(gateway, upstream):
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 64, "seed": 7})
    body = reply.json()
    assert [c["message"]["content"] for c in body["choices"]] == list(SCRIPT_TEXTS)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    sent = upstream.engine.requests[0]
    assert (sent.sampling.n, sent.sampling.seed) == (2, 7)


async def test_chat_prompt_is_the_rendered_template_without_extra_bos(gateway, upstream, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    await gateway.http.post("/v1/chat/completions", json={"messages": messages})
    rendered = tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    assert list(upstream.engine.requests[0].prompt_token_ids) == expected
    assert expected.count(tokenizer.hf.bos_token_id) == rendered.count(tokenizer.hf.bos_token)


async def test_chat_stream_starts_with_role_and_carries_content(gateway):
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "stream": True})
    chunks = [json.loads(e) for e in sse_events(reply.text)[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks[1:]) == SCRIPT_TEXTS[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_chat_logprobs_name_tokens_and_top_alternatives(gateway, upstream, tokenizer):
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    choice = reply.json()["choices"][0]
    assert upstream.engine.requests[0].sampling.logprobs == 2
    script = upstream.engine.scripts[0][:3]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [tokenizer.token_text(t) for t in script]
    assert [e["logprob"] for e in content] == [-0.5, -0.6, -0.7]
    assert [t["token"] for t in content[0]["top_logprobs"]] == [tokenizer.token_text(script[0]),
                                                                 tokenizer.token_text(script[0] + 1)]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert choice["finish_reason"] == "length"


async def test_completion_logprobs_have_offsets_into_the_text(gateway, upstream, tokenizer):
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "logprobs": 1})
    choice = reply.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    assert logprobs["token_logprobs"] == [-0.5, -0.6, -0.7, -0.8]
    assert logprobs["top_logprobs"][0] == {logprobs["tokens"][0]: -0.5}


async def test_return_tokens_as_token_ids_names_logprobs_by_id(gateway, upstream, tokenizer):
    """vLLM's return_tokens_as_token_ids: every logprob token is "token_id:N"; the text and the
    completions' text offsets stay those of the text."""
    script = upstream.engine.scripts[0][:3]
    names = [f"token_id:{t}" for t in script]
    chat = (await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
        "return_tokens_as_token_ids": True})).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == names
    assert [t["token"] for t in content[0]["top_logprobs"]] == [names[0], f"token_id:{script[0] + 1}"]
    assert content[0]["bytes"] == list(names[0].encode())
    assert chat["message"]["content"] == tokenizer.decode(script)
    stream = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "stream": True,
        "return_tokens_as_token_ids": True})
    streamed = [e["token"] for line in stream.text.splitlines() if line.startswith("data: {")
                for c in json.loads(line[6:])["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == names
    prompt = [5, 6]
    text = (await gateway.http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 3, "logprobs": 1, "echo": True,
        "return_tokens_as_token_ids": True})).json()["choices"][0]
    assert text["logprobs"]["tokens"] == [f"token_id:{t}" for t in prompt] + names
    assert text["logprobs"]["top_logprobs"][2] == {names[0]: -0.5}
    real = tokenizer.token_texts(prompt + script)
    assert text["logprobs"]["text_offset"] == [sum(len(t) for t in real[:i]) for i in range(len(real))]


async def test_echo_prepends_the_prompt(gateway):
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi there", "echo": True, "max_tokens": 2})
    assert reply.json()["choices"][0]["text"].startswith("Hi there")


async def test_prompt_as_token_ids_or_list_of_one_string(gateway, upstream):
    await gateway.http.post("/v1/completions", json={"prompt": [5, 6, 7]})
    await gateway.http.post("/v1/completions", json={"prompt": ["Hi"]})
    assert list(upstream.engine.requests[0].prompt_token_ids) == [5, 6, 7]
    assert upstream.engine.requests[1].prompt_token_ids[0] == 0  # BOS from the plain encode


async def test_vllm_extras_reach_the_engine(gateway, upstream):
    await gateway.http.post("/v1/completions", json={
        "prompt": "Hi", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
        "min_tokens": 2, "stop_token_ids": [9], "cache_salt": "tenant-a", "priority": 3,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "temperature": 0.0, "top_p": 0.9,
        "user": "u1"})
    sent = upstream.engine.requests[0]
    s = sent.sampling
    assert (s.top_k, round(s.min_p, 6), round(s.repetition_penalty, 6), s.ignore_eos, s.min_tokens) == (
        5, 0.1, 1.2, True, 2)
    assert (list(s.stop_token_ids), s.presence_penalty, s.frequency_penalty, s.temperature) == (
        [9], 0.5, -0.5, 0.0)
    assert (sent.cache_salt, sent.priority, round(s.top_p, 6)) == ("tenant-a", 3, 0.9)


async def test_models_tokenize_detokenize_version(gateway, tokenizer, tokenizer_dir):
    models = (await gateway.http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [tokenizer_dir]
    assert models["data"][0]["max_model_len"] == 256
    tokens = (await gateway.http.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert tokens["tokens"] == tokenizer.encode("Hello world") and tokens["count"] == len(tokens["tokens"])
    text = (await gateway.http.post("/detokenize", json={"tokens": tokens["tokens"][1:]})).json()
    assert text == {"prompt": "Hello world"}
    assert (await gateway.http.get("/version")).json() == {"version": "0.1.0"}


async def test_tokenize_has_vllms_completion_and_chat_shapes(gateway, upstream, tokenizer):
    """vLLM's TokenizeCompletionRequest / TokenizeChatRequest -> TokenizeResponse field for field."""
    plain = (await gateway.http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False})).json()
    expected = tokenizer.encode("Hello world", add_special_tokens=False)
    assert plain == {"count": len(expected), "max_model_len": 256, "tokens": expected, "token_strs": None}
    strs = (await gateway.http.post("/tokenize", json={"prompt": "Hello", "return_token_strs": True})).json()
    assert strs["token_strs"] == tokenizer.hf.convert_ids_to_tokens(tokenizer.encode("Hello"))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    chat = (await gateway.http.post("/tokenize", json={"messages": messages[:1]})).json()
    rendered = tokenizer.hf.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)  # chat: no second BOS
    doubled = (await gateway.http.post("/tokenize", json={"messages": messages[:1], "add_special_tokens": True})).json()
    assert doubled["tokens"] == [tokenizer.hf.bos_token_id] + chat["tokens"]
    # the same prompt /v1/chat/completions sends
    await gateway.http.post("/v1/chat/completions", json={"messages": messages[:1]})
    assert list(upstream.engine.requests[-1].prompt_token_ids) == chat["tokens"]
    open_end = (await gateway.http.post("/tokenize", json={
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True})).json()
    assert tokenizer.decode(open_end["tokens"], skip_special_tokens=False).endswith("Hel")
    for bad in ({}, {"prompt": "a", "messages": messages}, {"messages": messages, "continue_final_message": True}):
        reply = await gateway.http.post("/tokenize", json=bad)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "BadRequestError", bad
    wrong = await gateway.http.post("/detokenize", json={"tokens": [10**9]})
    assert wrong.status_code == 400 and "token ids" in wrong.json()["error"]["message"]


async def test_health_ready_and_metrics(make_gateway):
    not_connected = await make_gateway(connect=False)
    assert (await not_connected.http.get("/health")).status_code == 200
    assert (await not_connected.http.get("/ready")).status_code == 503
    connected = await make_gateway()
    assert (await connected.http.get("/ready")).status_code == 200
    await connected.http.post("/v1/completions", json={"prompt": "Hi"})
    metrics = (await connected.http.get("/metrics")).text
    assert 'pagoda:http_requests_total{route="/v1/completions",status="200"}' in metrics
    assert "vllm:time_to_first_token_seconds_count" in metrics


async def test_served_model_name_override(make_gateway):
    gateway = await make_gateway(served_model_name="tiny")
    assert (await gateway.http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi"})).status_code == 200
