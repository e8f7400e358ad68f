"""The disk tier and a quantized GGUF on a CUDA worker (tiny models): the CPU tests' figures on the
GPU. The disk tier writes device blocks (through the host tier) to files and loads them back into
device blocks after a restart; a Q8_0 GGUF on CUDA is served dequantised (the quantized linears run
on CPU only: docs/quantization.md), with the CPU run's greedy tokens."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.worker.gguf_files import Q, write_gguf
from tests.worker.test_disk_tier_worker import DISK_2_MIB, HOST_4_BLOCKS, restart_and_hit_the_disk_tier
from tests.worker.test_host_tier_worker import run_sessions
from tests.worker.test_quantized_loading import _hf_dir, _types
from tests.worker.test_session_snapshots_llm import restore_and_hit, save_two_turns


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pagoda.tools.tiny_model import write_model

    out = tmp_path_factory.mktemp("models") / "pagoda-tiny"
    write_model(out)
    return str(out)


def test_disk_tier_on_cuda(tiny_model_dir: str, tmp_path) -> None:
    plain, _, _ = run_sessions(tiny_model_dir, device="cuda")
    tiered, cached, stats = run_sessions(tiny_model_dir, device="cuda", kv_offloading_size=HOST_4_BLOCKS,
                                         kv_offload_dir=str(tmp_path), kv_offload_dir_size=DISK_2_MIB)
    assert tiered == plain
    assert stats.blocks_disk_written > 0 and stats.blocks_disk_loaded > 0
    assert cached[4:] == [32] * 4 + [80] * 4


def test_disk_tier_survives_a_restart_on_cuda(tiny_model_dir: str, tmp_path) -> None:
    restart_and_hit_the_disk_tier(tiny_model_dir, tmp_path, device="cuda")


def test_a_session_saved_on_cuda_restores_after_a_restart(tiny_model_dir: str, tmp_path) -> None:
    turn2, expected = save_two_turns(tiny_model_dir, str(tmp_path), device="cuda")
    restore_and_hit(tiny_model_dir, str(tmp_path), turn2, expected, device="cuda")


def test_q8_0_gguf_on_cuda_is_served_dequantised(tmp_path) -> None:
    path = write_gguf(tmp_path / "m.gguf", _hf_dir(tmp_path, tied=True), "llama", _types(Q.Q8_0, True))
    prompts = [{"prompt_token_ids": [5 + 7 * i % 240 for i in range(n)]} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for device, quantization in (("cuda", "auto"), ("cpu", "none")):
        # a small cache: the default fraction of the GPU may meet an earlier test's memory still
        # held by torch's caching allocator (the whole suite in one process)
        with LLM(model=str(path), dtype="float32", device=device, quantization=quantization,
                 kv_cache_memory_bytes=64 << 20) as llm:
            outs[device] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["cuda"] == outs["cpu"]
