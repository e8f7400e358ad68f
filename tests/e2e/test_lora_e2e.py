"""Multi-LoRA through the services (real worker, scheduler and gateway processes on loopback) with
the real `openai` client: adapters are models, each request's greedy output equals HF + PEFT with its
adapter while base and adapter requests run together, the prefix cache is isolated per adapter, and
adapters load and unload at run time."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest

from tests.e2e.conftest import start_scheduler, start_worker
from tests.e2e.gateway_conftest import start_gateway
from tests.worker.lora_adapters import SPECS, AdapterSpec, PeftReference, make_adapter, make_adapters

pytest.importorskip("peft")
pytestmark = pytest.mark.slow
MAX_TOKENS = 12
STATIC = SPECS[:3]  # --lora-modules; SPECS[3] is loaded at run time
PROMPTS = [[5 + (7 * i + 3 * j) % 1900 for j in range(4 + 5 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def lora_stack(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-e2e")
    adapters = make_adapters(tiny_model_dir, root / "adapters")
    logs = root / "logs"
    logs.mkdir()
    worker = start_worker(tiny_model_dir, logs, device="cpu", dtype="float32", num_gpu_blocks_override=512,
                          enable_lora=True, max_loras=4, max_lora_rank=16)
    processes = [worker]
    try:
        processes.append(start_scheduler(worker.target, logs, max_num_seqs=32, max_num_batched_tokens=512))
        gateway, http_url = start_gateway(processes[-1].target, logs, "--lora-modules",
                                          *(f"{s.name}={adapters[s.name]}" for s in STATIC))
        processes.append(gateway)
        from transformers import AutoTokenizer

        from worker_svc.model_loader.model_config import ModelConfig

        yield {"http_url": http_url, "grpc_target": gateway.target, "adapters": adapters,
               "reference": PeftReference(tiny_model_dir, adapters), "model": str(tiny_model_dir),
               "tokenizer": AutoTokenizer.from_pretrained(tiny_model_dir),
               "eos": list(ModelConfig.from_dir(tiny_model_dir).eos_token_ids)}
    finally:
        for process in reversed(processes):
            process.stop()


@pytest.fixture
def client(lora_stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{lora_stack['http_url']}/v1", api_key="unused", max_retries=0)


def expected_text(stack, prompt: list[int], adapter: str | None) -> tuple[str, int]:
    ids = stack["reference"].generate(prompt, MAX_TOKENS, adapter, stack["eos"])
    return stack["tokenizer"].decode(ids, skip_special_tokens=True), len(ids)


async def complete(client, model: str, prompt: list[int]):
    return await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)


async def test_models_lists_the_adapters_with_their_base_as_parent(client, lora_stack):
    cards = {m.id: m for m in (await client.models.list()).data}
    assert set(cards) == {lora_stack["model"], *(s.name for s in STATIC)}
    for spec in STATIC:
        assert cards[spec.name].model_extra["parent"] == lora_stack["model"]
        assert cards[spec.name].model_extra["root"] == str(lora_stack["adapters"][spec.name])


async def test_base_and_three_adapters_together_match_hf_peft(client, lora_stack):
    """All requests are sent at once, so the engine runs them in the same steps."""
    models = [lora_stack["model"], *(s.name for s in STATIC)]
    assigned = [models[i % len(models)] for i in range(len(PROMPTS))]
    replies = await asyncio.gather(*(complete(client, m, p) for m, p in zip(assigned, PROMPTS, strict=True)))
    for model, prompt, reply in zip(assigned, PROMPTS, replies, strict=True):
        adapter = None if model == lora_stack["model"] else model
        text, num_tokens = await asyncio.to_thread(expected_text, lora_stack, prompt, adapter)
        if adapter is not None:  # the adapter matters: its output is not the base model's
            assert text != (await asyncio.to_thread(expected_text, lora_stack, prompt, None))[0]
        assert reply.model == model
        assert (reply.choices[0].text, reply.usage.completion_tokens) == (text, num_tokens), model


async def test_prefix_cache_is_isolated_between_adapters(client, lora_stack):
    prompt = list(range(100, 150))  # 3 full blocks of 16

    async def cached(model: str) -> int:
        reply = await complete(client, model, prompt)
        return reply.usage.prompt_tokens_details.cached_tokens

    first, second = STATIC[0].name, STATIC[1].name
    assert await cached(first) == 0
    assert await cached(second) == 0  # the same tokens under another adapter: no hit
    assert await cached(lora_stack["model"]) == 0  # nor for the base model
    assert await cached(first) == 48  # the same adapter again: its own blocks


async def test_load_serve_and_unload_an_adapter_at_run_time(client, lora_stack):
    spec = SPECS[3]
    path = str(lora_stack["adapters"][spec.name])
    async with httpx.AsyncClient(base_url=lora_stack["http_url"], timeout=30) as http:
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": spec.name, "lora_path": path})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        again = await http.post("/v1/load_lora_adapter", json={"lora_name": spec.name, "lora_path": path})
        assert again.status_code == 400
        assert spec.name in {m.id for m in (await client.models.list()).data}
        reply = await complete(client, spec.name, PROMPTS[5])
        text, _ = await asyncio.to_thread(expected_text, lora_stack, PROMPTS[5], spec.name)
        assert reply.choices[0].text == text
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": spec.name})
        assert unloaded.status_code == 200
        with pytest.raises(openai.NotFoundError):
            await complete(client, spec.name, PROMPTS[5])
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": spec.name})).status_code == 404


async def test_adapters_the_worker_cannot_serve_are_refused_at_load(lora_stack, tmp_path):
    big = make_adapter(lora_stack["model"], tmp_path / "r32", AdapterSpec("r32", 32, ("q_proj",)))
    async with httpx.AsyncClient(base_url=lora_stack["http_url"], timeout=30) as http:
        too_big = await http.post("/v1/load_lora_adapter", json={"lora_name": "r32", "lora_path": str(big)})
        missing = await http.post("/v1/load_lora_adapter",
                                  json={"lora_name": "gone", "lora_path": str(tmp_path / "missing")})
        clash = await http.post("/v1/load_lora_adapter",
                                json={"lora_name": lora_stack["model"], "lora_path": str(big)})
    assert too_big.status_code == 400 and "max-lora-rank" in too_big.json()["error"]["message"]
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert clash.status_code == 400


async def test_public_grpc_takes_the_adapter_as_its_model(lora_stack):
    from pagoda.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    spec = STATIC[2]
    request = gateway_pb2.GenerationRequest(model=spec.name, prompt="The river flows",
                                            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    async with grpc.aio.insecure_channel(lora_stack["grpc_target"]) as channel:
        chunks = [c async for c in gateway_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)]
    prompt = lora_stack["tokenizer"]("The river flows")["input_ids"]
    expected = await asyncio.to_thread(lora_stack["reference"].generate, prompt, MAX_TOKENS, spec.name,
                                       lora_stack["eos"])
    assert [t for c in chunks for t in c.token_ids] == expected
    assert chunks[-1].model == spec.name


async def test_an_adapter_whose_files_vanish_fails_its_request_alone(client, lora_stack, tmp_path):
    """Registered, then deleted before first use: the worker cannot load it, so that request fails
    (HTTP 500 from the scheduler's poison isolation) while a base request sent with it completes."""
    import shutil

    path = tmp_path / "doomed"
    shutil.copytree(lora_stack["adapters"][SPECS[0].name], path)
    async with httpx.AsyncClient(base_url=lora_stack["http_url"], timeout=30) as http:
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "doomed", "lora_path": str(path)})
        assert loaded.status_code == 200
    (path / "adapter_model.safetensors").unlink()
    doomed, base = await asyncio.gather(complete(client, "doomed", PROMPTS[1]),
                                        complete(client, lora_stack["model"], PROMPTS[2]),
                                        return_exceptions=True)
    assert isinstance(doomed, openai.InternalServerError), doomed
    text, _ = await asyncio.to_thread(expected_text, lora_stack, PROMPTS[2], None)
    assert base.choices[0].text == text
    reply = await complete(client, STATIC[0].name, PROMPTS[3])  # the engine keeps serving adapters
    assert reply.choices[0].text == (await asyncio.to_thread(expected_text, lora_stack, PROMPTS[3],
                                                             STATIC[0].name))[0]


async def test_metrics_carry_vllm_lora_requests_info(lora_stack):
    async with httpx.AsyncClient(base_url=lora_stack["http_url"], timeout=30) as http:
        text = (await http.get("/metrics")).text
    (line,) = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert 'max_lora="4"' in line and 'running_lora_adapters=""' in line  # idle between tests
