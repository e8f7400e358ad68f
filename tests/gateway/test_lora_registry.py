"""The gateway's LoRA registry: flags, names, ids, the adapter's pool and the engine request it sends."""

import json

import pytest

from gateway.__main__ import parse_args
from gateway.errors import ModelNotFoundError
from gateway.upstream.lora_adapters import LoRARegistry, parse_lora_module
from gateway.upstream.model_pools import ModelPool, ModelPools
from pagoda.contract.errors import InvalidRequestError
from pagoda.entrypoints.launcher.cli import parse_args as launcher_args
from pagoda.entrypoints.launcher.topology import build_children
from pagoda.v1 import engine_pb2


def adapter_dir(tmp_path, name, rank=8):
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16,
                                                          "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


class RecordingClient:
    def __init__(self):
        self.sent = []

    def generate(self, request, metadata=()):
        self.sent.append(request)
        return "stream"


def test_flags_reach_the_config_and_the_launcher_passes_them_on(tmp_path):
    path = adapter_dir(tmp_path, "sql")
    config = parse_args(["--lora-modules", f"sql={path}", f"chat={path}"])
    assert config.lora_modules == (("sql", path), ("chat", path))
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("no-path")
    children = {c.name: c.argv for c in build_children(launcher_args(
        ["--model", "m", "--lora-modules", f"sql={path}", "--max-loras", "4"]))}
    assert children["worker"][-5:] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
    assert children["gateway"][-2:] == ["--lora-modules", f"sql={path}"]


def test_adapters_resolve_to_their_base_pool_and_stamp_their_request(tmp_path):
    client = RecordingClient()
    base = ModelPool("base", client)
    base.info = engine_pb2.EngineInfo(model_name="base", max_loras=2, max_lora_rank=16)
    pools = ModelPools([base], adapters=LoRARegistry([("sql", adapter_dir(tmp_path, "sql"))]))
    pool = pools.resolve("sql")
    assert (pool.name, pool.base, pool.info) == ("sql", base, base.info)
    pool.client.generate(engine_pb2.GenerateRequest(request_id="r"))
    assert (client.sent[0].lora.lora_name, client.sent[0].lora.lora_int_id) == ("sql", 1)
    assert pools.resolve("base") is base  # the base model itself: no adapter
    with pytest.raises(ModelNotFoundError):
        pools.resolve("other")
    (card,) = [c for c in pools.cards() if c["id"] == "sql"]
    assert card["parent"] == "base"


def test_load_checks_name_rank_and_lora_support(tmp_path):
    base = ModelPool("base", RecordingClient())
    base.tokenizer = object()
    base.info = engine_pb2.EngineInfo(model_name="base", max_loras=2, max_lora_rank=16)
    registry = LoRARegistry()
    assert registry.load("a", adapter_dir(tmp_path, "a"), base, ["base"]).lora.lora_int_id == 1
    with pytest.raises(InvalidRequestError, match="already"):
        registry.load("a", adapter_dir(tmp_path, "a2"), base, ["base"])
    with pytest.raises(InvalidRequestError, match="served model"):
        registry.load("base", adapter_dir(tmp_path, "b"), base, ["base"])
    with pytest.raises(InvalidRequestError, match="max-lora-rank"):
        registry.load("big", adapter_dir(tmp_path, "big", rank=64), base, ["base"])
    assert registry.get("big") is None  # a refused load leaves nothing behind
    with pytest.raises(InvalidRequestError, match="no LoRA adapter"):  # a 400, not an OSError's 500
        registry.load("long", str(tmp_path / ("x" * 300)), base, ["base"])
    base.info = engine_pb2.EngineInfo(model_name="base")
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        registry.load("c", adapter_dir(tmp_path, "c"), base, ["base"])
    registry.remove("a")
    with pytest.raises(ModelNotFoundError):
        registry.remove("a")


def test_replica_routing_keys_follow_the_adapter_like_the_scheduler_cache():
    from gateway.upstream.routing import routing_key
    from pagoda.contract.lora import LoRARequest

    prompt = list(range(40))
    keys = {routing_key(prompt, "", 16, 2, lora) for lora in
            (None, LoRARequest("a", 1, "/a").cache_key, LoRARequest("b", 2, "/b").cache_key)}
    assert len(keys) == 3
