"""The prefix cache's disk tier on the real worker (tiny model, CPU, fp32), through `LLM`:

- 4 sessions x 3 turns in 14 device blocks and a host tier of only 4 blocks: the host tier's drops
  go to files, later turns load them back; greedy tokens identical to the run without any tier.
- A restart: the LLM is closed and a new one opened on the same directory; the next turn of a
  session whose blocks went to disk is a prefix hit from disk, its output identical to a run with
  neither tier nor restart.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.contract.errors import PlanError
from pagoda.contract.prefix_hash import hash_block
from tests.worker.test_host_tier_worker import run_sessions
from tests.worker.test_swap_worker import check_invariants_every_step

HOST_4_BLOCKS = 4 * 64 / (1 << 20)  # GiB: a tiny-model block is 64 KiB (16 slots, every layer's K and V)
DISK_2_MIB = 2 / 1024  # 30 files of 64 KiB + 4 KiB


def test_disk_tier_is_token_identical_and_serves_blocks_the_host_dropped(tiny_model_dir: str, tmp_path) -> None:
    plain, _, _ = run_sessions(tiny_model_dir)
    tiered, cached, stats = run_sessions(tiny_model_dir, kv_offloading_size=HOST_4_BLOCKS,
                                         kv_offload_dir=str(tmp_path), kv_offload_dir_size=DISK_2_MIB)
    assert tiered == plain
    assert (stats.num_offload_blocks, stats.num_disk_blocks) == (4, 30)
    assert stats.blocks_disk_written > 0 and stats.blocks_disk_loaded > 0
    # The host tier alone (64 blocks) gave every later turn its whole history, 32 then 80 tokens:
    # 4 host blocks and the disk under them give the same.
    assert cached[4:] == [32] * 4 + [80] * 4
    (fingerprint_dir,) = tmp_path.iterdir()
    assert len(list(fingerprint_dir.glob("*.safetensors"))) == stats.num_disk_blocks * stats.disk_kv_usage


def turn(llm: LLM, prompt: list[int]):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                          ignore_eos=True), use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_a_restart_keeps_the_disk_tier_next_turn_hits_it(tiny_model_dir: str, tmp_path) -> None:
    restart_and_hit_the_disk_tier(tiny_model_dir, tmp_path, device="cpu")


def restart_and_hit_the_disk_tier(tiny_model_dir: str, tmp_path, device: str) -> None:
    """Shared with tests/gpu (the same figures on CUDA)."""
    session = [(7 * i) % 2000 + 10 for i in range(48)]  # 3 full blocks
    others = [[(13 * i + k * 101) % 2000 + 10 for i in range(48)] for k in range(4)]
    tiers = dict(kv_offloading_size=HOST_4_BLOCKS, kv_offload_dir=str(tmp_path), kv_offload_dir_size=DISK_2_MIB)
    llm = LLM(model=tiny_model_dir, dtype="float32", device=device, seed=0, num_gpu_blocks_override=8, **tiers)
    check_invariants_every_step(llm)
    reply, _ = turn(llm, session)
    for other in others:  # 4 x 4 blocks through 8 device blocks and 4 host slots: the session goes to disk
        turn(llm, other)
    assert llm.stats().blocks_disk_written >= 3
    llm.close()
    next_turn = session + reply + [1000 + i for i in range(10)]  # 66 tokens: 4 full blocks

    restarted = LLM(model=tiny_model_dir, dtype="float32", device=device, seed=0, num_gpu_blocks_override=8, **tiers)
    check_invariants_every_step(restarted)
    assert restarted.stats().disk_kv_usage > 0  # the new worker listed the files
    out, cached = turn(restarted, next_turn)
    # The session's 3 prompt blocks were written to disk; the reply's block was registered too.
    assert cached == 48 and restarted.stats().blocks_disk_loaded == 3
    restarted.close()

    fresh = LLM(model=tiny_model_dir, dtype="float32", device=device, seed=0, num_gpu_blocks_override=8)
    expected, fresh_cached = turn(fresh, next_turn)
    assert fresh_cached == 0 and out == expected


def test_the_disk_tier_needs_the_host_tier(tiny_model_dir: str, tmp_path) -> None:
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        LLM(model=tiny_model_dir, dtype="float32", device="cpu", kv_offload_dir=str(tmp_path))


def test_a_corrupt_file_is_refused_at_init_and_at_load_never_served(tiny_model_dir: str, tmp_path) -> None:
    """The session's second block file is corrupted before the restart (refused and deleted when the
    new worker lists the directory), its first after (refused when the plan that loads it is
    validated: that generate fails, nothing served; the LLM lists the directory again and the
    next generate recomputes, its output identical to a run without tiers)."""
    session = [(7 * i) % 2000 + 10 for i in range(48)]
    tiers = dict(kv_offloading_size=HOST_4_BLOCKS, kv_offload_dir=str(tmp_path), kv_offload_dir_size=DISK_2_MIB)
    llm = LLM(model=tiny_model_dir, dtype="float32", device="cpu", seed=0, num_gpu_blocks_override=8, **tiers)
    reply, _ = turn(llm, session)
    for k in range(4):
        turn(llm, [(13 * i + k * 101) % 2000 + 10 for i in range(48)])
    llm.close()
    (folder,) = tmp_path.iterdir()
    first = hash_block(None, session[:16])
    files = [folder / f"{h.hex()}.safetensors" for h in (first, hash_block(first, session[16:32]))]
    assert all(f.exists() for f in files)
    data = bytearray(files[1].read_bytes())
    data[-3] ^= 0x10  # one bit of the second block's payload
    files[1].write_bytes(bytes(data))
    next_turn = session + reply + [1000 + i for i in range(10)]
    fresh = LLM(model=tiny_model_dir, dtype="float32", device="cpu", seed=0, num_gpu_blocks_override=8)
    expected, _ = turn(fresh, next_turn)
    del fresh

    restarted = LLM(model=tiny_model_dir, dtype="float32", device="cpu", seed=0, num_gpu_blocks_override=8, **tiers)
    assert not files[1].exists()  # refused by the listing: deleted
    data = bytearray(files[0].read_bytes())
    data[-3] ^= 0x10  # the first block's, after the new worker's Init verified it
    files[0].write_bytes(bytes(data))
    with pytest.raises(PlanError, match="checksum"):
        turn(restarted, next_turn)
    assert not files[0].exists()
    out, cached = turn(restarted, next_turn)
    assert (out, cached) == (expected, 0)
    restarted.close()
