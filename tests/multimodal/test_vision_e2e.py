"""Images end to end over real worker, scheduler and gateway processes on loopback, with the tiny
LLaVA: the `openai` client's data-URL image_url part, the `anthropic` client's base64 image block
and a Responses input_image all get HF's greedy answer; a repeat hits the prefix cache; bad images
are 400s naming the part, and the server keeps serving."""

from __future__ import annotations

import base64

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import start_scheduler, start_worker
from tests.e2e.gateway_conftest import start_gateway
from tests.multimodal.conftest import make_image, png_bytes
from tests.multimodal.test_llava_parity import PROMPT_1, hf_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 12  # test_llava_parity's, so hf_greedy's answer is this long
TEXT = "Describe the picture."
GREEDY = {"temperature": 0, "ignore_eos": True}
GREEDY_ONLY = {"temperature": 0}  # Messages and Responses have no ignore_eos (the tiny model's EOS never wins)


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@pytest.fixture(scope="module")
def stack(llava_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vision-logs")
    worker = start_worker(llava_dir, logs, device="cpu", dtype="float32", num_gpu_blocks_override=256,
                          block_size=4)
    scheduler = gateway = None
    try:
        scheduler = start_scheduler(worker.target, logs, max_num_batched_tokens=16)  # chunks cut images
        gateway, url = start_gateway(scheduler.target, logs, "--limit-mm-per-prompt", '{"image": 2}',
                                     "--max-image-pixels", "20000")
        yield url, llava_dir, gateway.target  # (base URL, the model's name: its path, public gRPC)
    finally:
        for process in (gateway, scheduler, worker):
            if process is not None:
                process.stop()


@pytest.fixture(scope="module")
def expected(hf_llava, llava_dir):
    from transformers import AutoTokenizer

    ids, out = hf_greedy(hf_llava, llava_dir, PROMPT_1, [make_image(1)])
    return len(ids), AutoTokenizer.from_pretrained(llava_dir).decode(out, skip_special_tokens=True)


def chat_parts(url: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]


def test_openai_client_image_url(stack, expected):
    stack, model, _ = stack
    client = openai.OpenAI(base_url=f"{stack}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": chat_parts(data_url(make_image(1)))}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, extra_body=GREEDY)
    assert (first.usage.prompt_tokens, first.choices[0].message.content) == expected
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, extra_body=GREEDY)
    assert again.choices[0].message.content == expected[1]
    assert again.usage.prompt_tokens_details.cached_tokens == (expected[0] - 1) // 4 * 4  # every full block
    other = [{"role": "user", "content": chat_parts(data_url(make_image(2)))}]
    third = client.chat.completions.create(model=model, messages=other, max_tokens=MAX_TOKENS, extra_body=GREEDY)
    assert third.choices[0].message.content != expected[1]
    assert third.usage.prompt_tokens_details.cached_tokens == 4  # only the block before the image
    # 16-token chunks cut the first image: its later chunk is an encoder-cache hit, not a second
    # encoding (two images, 16 rows each, encoded once each)
    metrics = httpx.get(f"{stack}/metrics", timeout=10).text
    counts = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith(("pagoda:encoder_tokens_total", "pagoda:encoder_cache_hits_total"))}
    assert counts["pagoda:encoder_tokens_total"] == 32.0 and counts["pagoda:encoder_cache_hits_total"] >= 1, counts


def test_anthropic_client_base64_image(stack, expected):
    stack, model, _ = stack
    client = anthropic.Anthropic(base_url=stack, api_key="unused", max_retries=0)
    data = base64.b64encode(png_bytes(make_image(1))).decode()
    reply = client.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body=GREEDY_ONLY, messages=[{
        "role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": TEXT}]}])
    assert reply.content[0].text == expected[1]
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(b"not a png").decode()}}]}])
    assert "messages[0].content[1]" in str(error.value)


def test_responses_input_image(stack, expected):
    stack, model, _ = stack
    body = {"model": model, "max_output_tokens": MAX_TOKENS, **GREEDY_ONLY, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(make_image(1))}, {"type": "input_text", "text": TEXT}]}]}
    reply = httpx.post(f"{stack}/v1/responses", json=body, timeout=120).json()
    assert reply["output"][-1]["content"][0]["text"] == expected[1]


@pytest.mark.parametrize("parts, says", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hello").decode()}}],
     "messages[0].content[0]: not an image"),
    ("truncated", "messages[0].content[1]: the image cannot be decoded"),
    ([{"type": "image_url", "image_url": {"url": "http://203.0.113.9/cat.png"}}],
     "messages[0].content[0]: image URLs from '203.0.113.9' are refused"),
    ("large", "messages[0].content[0]: the image is 200x200 pixels"),
    ("three", "3 images in the prompt; at most 2"),
])
def test_bad_images_are_400s_naming_the_part(stack, expected, parts, says):
    stack, model, _ = stack
    if parts == "truncated":
        whole = png_bytes(make_image(5))
        url = "data:image/png;base64," + base64.b64encode(whole[:len(whole) // 2]).decode()
        parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": url}}]
    elif parts == "large":
        parts = chat_parts(data_url(make_image(6, (200, 200))))
    elif parts == "three":
        parts = [chat_parts(data_url(make_image(i)))[0] for i in range(3)]
    response = httpx.post(f"{stack}/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and error["type"] == "BadRequestError", error
    if "messages[0]" in says:  # the part, as OpenAI names a bad field
        assert error["param"] == says.split(":")[0]
    # ...and the server keeps serving
    ok = httpx.post(f"{stack}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": MAX_TOKENS, **GREEDY,
        "messages": [{"role": "user", "content": chat_parts(data_url(make_image(1)))}]})
    assert ok.json()["choices"][0]["message"]["content"] == expected[1]


def test_public_grpc_api_takes_image_bytes(stack, expected):
    import grpc

    from pagoda.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    url, model, grpc_target = stack
    request = gateway_pb2.GenerationRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=f"<image>{TEXT}")]),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        images=[png_bytes(make_image(1))])
    with grpc.insecure_channel(grpc_target) as channel:
        stub = gateway_pb2_grpc.GenerationStub(channel)
        text = "".join(chunk.text for chunk in stub.Generate(request, timeout=120))
        assert text == expected[1]
        bad = gateway_pb2.GenerationRequest(prompt="<image>hi", images=[b"not an image"])
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(bad, timeout=60))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "images[0]" in error.value.details()
