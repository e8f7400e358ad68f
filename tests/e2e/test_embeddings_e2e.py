"""POST /v1/embeddings through real processes with the real `openai` client: the tiny model with
the default last-token pooling (shapes, inputs, base64, usage, 400s), the public gRPC Embed giving
the HTTP route's vectors exactly, and SmolLM2-135M-Instruct with `--pooling-type mean`, where a
paraphrase is nearer than an unrelated sentence (over HTTP and over gRPC)."""

from __future__ import annotations

import base64

import grpc
import httpx
import numpy as np
import openai
import pytest

from pagoda.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import start_scheduler, start_worker
from tests.e2e.gateway_conftest import start_gateway

TINY_HIDDEN = 256  # models/pagoda-tiny's hidden_size


def _tokens(http_url: str, text: str) -> list[int]:
    return httpx.post(f"{http_url}/tokenize", json={"prompt": text}).json()["tokens"]


@pytest.fixture
def client(gateway_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_stack.http_url}/v1", api_key="unused", max_retries=0)


def test_tiny_model_embeddings_shapes_inputs_and_usage(client, gateway_stack) -> None:
    texts = ["Hello world", "The quick brown fox jumps"]
    reply = client.embeddings.create(model=gateway_stack.model_dir, input=texts)
    # (the openai client asks for base64 when no encoding_format is given, and decodes it)
    assert [d.index for d in reply.data] == [0, 1] and reply.object == "list"
    vectors = np.array([d.embedding for d in reply.data])
    assert vectors.shape == (2, TINY_HIDDEN)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # L2-normalised
    assert not np.allclose(vectors[0], vectors[1])
    counts = [len(_tokens(gateway_stack.http_url, t)) for t in texts]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(counts)
    # Token ids (one list, a list of lists) give the same vectors as the text; so does base64.
    ids = [_tokens(gateway_stack.http_url, t) for t in texts]
    one = client.embeddings.create(model=gateway_stack.model_dir, input=ids[0])
    np.testing.assert_allclose(one.data[0].embedding, vectors[0], atol=1e-5)
    both = client.embeddings.create(model=gateway_stack.model_dir, input=ids)
    np.testing.assert_allclose([d.embedding for d in both.data], vectors, atol=1e-5)
    raw = httpx.post(f"{gateway_stack.http_url}/v1/embeddings",
                     json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vectors[0], atol=1e-6)
    assert raw["usage"] == {"prompt_tokens": counts[0], "total_tokens": counts[0]}


def grpc_embed(target: str, request: gateway_pb2.EmbedRequest) -> gateway_pb2.EmbedResponse:
    with grpc.insecure_channel(target) as channel:
        return gateway_pb2_grpc.GenerationStub(channel).Embed(request, timeout=60)


def test_grpc_embed_gives_the_http_routes_vectors(client, gateway_stack) -> None:
    texts = ["Hello world", "The quick brown fox jumps", "Hello world"]
    http = client.embeddings.create(model=gateway_stack.model_dir, input=texts, encoding_format="float")
    reply = grpc_embed(gateway_stack.grpc_target, gateway_pb2.EmbedRequest(texts=texts))
    # Both carry the worker's float32 values untouched: equal, not merely close.
    assert [list(e.values) for e in reply.embeddings] == [d.embedding for d in http.data]
    assert reply.model == http.model and reply.usage.prompt_tokens == http.usage.prompt_tokens
    plain = grpc_embed(gateway_stack.grpc_target, gateway_pb2.EmbedRequest(texts=texts[:1], add_special_tokens=False))
    unmarked = httpx.post(f"{gateway_stack.http_url}/v1/embeddings",
                          json={"input": texts[0], "add_special_tokens": False}).json()
    assert list(plain.embeddings[0].values) == unmarked["data"][0]["embedding"]
    for bad in (gateway_pb2.EmbedRequest(), gateway_pb2.EmbedRequest(texts=["ok", ""]),
                gateway_pb2.EmbedRequest(texts=["x " * 4000])):
        with pytest.raises(grpc.RpcError) as refused:
            grpc_embed(gateway_stack.grpc_target, bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("kwargs", [
    {"input": "hi", "dimensions": 8},
    {"input": []},
    {"input": [10**9]},
    {"input": "x " * 4000},
])
def test_bad_embedding_requests_are_400(client, gateway_stack, kwargs) -> None:
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=gateway_stack.model_dir, **kwargs)


@pytest.fixture(scope="module")
def smollm2_mean(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("smollm2-embed")
    processes = [start_worker(smollm2_dir, logs, device="cpu", dtype="float32",
                              kv_cache_memory_bytes=128 << 20, pooling_type="mean")]
    try:
        processes.append(start_scheduler(processes[0].target, logs, max_num_seqs=8, max_num_batched_tokens=8))
        gateway, http_url = start_gateway(processes[1].target, logs)
        processes.append(gateway)
        yield http_url, gateway
    finally:
        for process in reversed(processes):
            process.stop()


def test_smollm2_mean_pooling_ranks_a_paraphrase_above_an_unrelated_text(smollm2_mean) -> None:
    """Mean pooling (max_num_batched_tokens 8: every sentence is prefilled in chunks)."""
    url, gateway = smollm2_mean
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for anchor, paraphrase, unrelated in [
            ("The cat is sleeping on the sofa.", "A kitten naps on the couch.",
             "Interest rates rose sharply at the central bank."),
            ("How do I bake bread at home?", "What is a simple recipe for homemade bread?",
             "The rocket launched into orbit yesterday.")]:
        reply = client.embeddings.create(model=model, input=[anchor, paraphrase, unrelated])
        a, p, u = (np.array(d.embedding) for d in reply.data)
        assert a @ p > a @ u + 0.1, (a @ p, a @ u)  # unit vectors: dot = cosine similarity
        counts = [len(_tokens(url, t)) for t in (anchor, paraphrase, unrelated)]
        assert reply.usage.prompt_tokens == sum(counts)
        over_grpc = grpc_embed(gateway.target, gateway_pb2.EmbedRequest(texts=[anchor, paraphrase, unrelated]))
        # The same vectors within fp32 rounding, not bit for bit: each route's texts arrive at their
        # own times, so their 8-token chunks share steps differently, and oneDNN's fp32 GEMM may
        # round a row differently at another row count (the tiny model's test above is exact).
        np.testing.assert_allclose([list(e.values) for e in over_grpc.embeddings],
                                   [d.embedding for d in reply.data], rtol=1e-4, atol=1e-6)
