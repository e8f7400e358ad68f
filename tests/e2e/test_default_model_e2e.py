"""The real default model, SmolLM2-135M-Instruct, through the real services: worker, scheduler and
gateway processes on loopback, asked by the `openai` client and the public gRPC stream.

Two stacks: the GGUF file served directly in fp32 (the worker loads it, the gateway builds its
tokenizer from it), whose greedy tokens must equal HF transformers' on the same file; and the
converted directory in bf16, which must still answer the README's question.
"""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from tests.e2e.conftest import start_scheduler, start_worker
from tests.e2e.gateway_conftest import start_gateway
from tests.smollm2_fixtures import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow
KV_BYTES = 64 << 20
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module", params=["gguf-float32", "dir-bfloat16"])
def smollm2_stack(request, smollm2_gguf, smollm2_dir, tmp_path_factory):
    source, dtype = request.param.split("-")
    model = smollm2_gguf if source == "gguf" else smollm2_dir
    logs = tmp_path_factory.mktemp(f"smollm2-{request.param}")
    # exact HF parity below is a property of the dequantised GGUF (--quantization none); the GGUF as
    # stored (the default) is held to >= 90% of HF's tokens in tests/worker/test_quantized_loading.py
    exact = {"quantization": "none"} if source == "gguf" else {}
    processes = [start_worker(model, logs, device="cpu", dtype=dtype, kv_cache_memory_bytes=KV_BYTES, **exact)]
    try:
        processes.append(start_scheduler(processes[0].target, logs, max_num_seqs=8))
        gateway, http_url = start_gateway(processes[1].target, logs)
        processes.append(gateway)
        yield request.param, http_url, gateway.target
    finally:
        for process in reversed(processes):
            process.stop()


def test_chat_answers_the_readme_question(smollm2_stack):
    _, http_url, _ = smollm2_stack
    client = openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    # the model's own EOS (<|im_end|>) ends the answer, and no template token leaks into the text
    assert choice.finish_reason == "stop"
    assert "<|im" not in choice.message.content


async def _generate_chat(target: str, prompt: str) -> list[int]:
    from pagoda.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerationRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=prompt)]),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    async with grpc.aio.insecure_channel(target) as channel:
        chunks = [c async for c in gateway_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)]
    return [token for chunk in chunks for token in chunk.token_ids]


def test_fp32_gguf_is_token_identical_to_hf_through_the_services(smollm2_stack, hf_greedy):
    name, _, grpc_target = smollm2_stack
    if name != "gguf-float32":
        pytest.skip("exact parity is an fp32 property; bf16 is held to a tolerance in tests/worker")

    async def all_at_once() -> list[list[int]]:  # eight concurrent streams: batched by the scheduler
        return await asyncio.gather(*(_generate_chat(grpc_target, p) for p in PROMPTS))

    outputs = asyncio.run(all_at_once())
    for prompt, output, expected in zip(PROMPTS, outputs, hf_greedy, strict=True):
        assert output == expected, prompt
