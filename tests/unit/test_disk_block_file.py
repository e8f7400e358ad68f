"""The disk tier's files on the worker (worker_svc/disk_tier/): a block round-trips bit for bit (FP8
included), a corrupt, truncated, renamed or foreign-model file is refused and deleted, never served,
the listing is least recently used first and trimmed to the cap, and a refused load fails loudly."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.contract.prefix_hash import hash_block
from pagoda.contract.step import DiskBlock, DiskLoad, DiskWrite
from worker_svc.disk_tier.block_file import (
    BlockFileRefused,
    model_fingerprint,
    read_block_file,
    write_block_file,
)
from worker_svc.disk_tier.store import DiskStore, num_disk_blocks
from worker_svc.kv_cache import raw_view

SHAPE = (2, 2, 4, 3, 8)  # [layers, K/V, block_size, kv heads, head_dim]
BLOCK = DiskBlock(hash_block(None, [5, 6, 7, 8], ("tenant",)), (5, 6, 7, 8), ("tenant", ("lora", "sql")))


def fingerprint(model: str = "/models/a", dtype=torch.float32) -> str:
    return model_fingerprint(model, dtype, dtype, "auto", 4, 2, 3, 8)


def test_round_trip_is_bit_exact(tmp_path):
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        payload = raw_view(torch.randn(SHAPE).to(dtype))
        path = tmp_path / (BLOCK.block_hash.hex() + ".safetensors")
        write_block_file(path, payload, BLOCK, fingerprint(dtype=dtype))
        loaded, block = read_block_file(path, fingerprint(dtype=dtype))
        assert torch.equal(loaded, payload) and loaded.dtype == payload.dtype and block == BLOCK
        assert not list(tmp_path.glob("*.tmp"))


def test_corrupt_truncated_renamed_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / (BLOCK.block_hash.hex() + ".safetensors")
    write_block_file(path, raw_view(torch.randn(SHAPE)), BLOCK, fingerprint())
    data = bytearray(path.read_bytes())
    with pytest.raises(BlockFileRefused, match="another model"):
        read_block_file(path, fingerprint("/models/b"))
    with pytest.raises(BlockFileRefused, match="another model"):  # same model, another dtype
        read_block_file(path, fingerprint(dtype=torch.bfloat16))
    data[-5] ^= 0x01  # one bit of the payload
    path.write_bytes(bytes(data))
    with pytest.raises(BlockFileRefused, match="checksum"):
        read_block_file(path, fingerprint())
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(BlockFileRefused, match="unreadable"):
        read_block_file(path, fingerprint())
    other = tmp_path / ("00" * 32 + ".safetensors")
    write_block_file(other, raw_view(torch.randn(SHAPE)), BLOCK, fingerprint())
    other.rename(tmp_path / ("11" * 32 + ".safetensors"))  # a file under another block's name
    with pytest.raises(BlockFileRefused, match="named"):
        read_block_file(tmp_path / ("11" * 32 + ".safetensors"), fingerprint())


def blocks(n: int) -> list[DiskBlock]:
    return [DiskBlock(hash_block(None, [i] * 4), (i,) * 4) for i in range(n)]


def test_store_writes_lists_lru_first_trims_and_refuses(tmp_path):
    host = raw_view(torch.randn(2, 2, 5, 4, 3, 8))  # a host pool of 5 blocks
    store = DiskStore(tmp_path, fingerprint(), capacity=3)
    a, b, c, d = blocks(4)
    store.delete_and_write(host, host, [], [DiskWrite(0, a), DiskWrite(1, b), DiskWrite(2, c)])
    for i, block in enumerate((a, b, c)):  # distinct modification times, oldest first
        os.utime(store.path(block.block_hash), ns=(10**18 + i, 10**18 + i))
    cache = torch.zeros(2, 2, 6, 4, 3, 8, dtype=torch.int32)
    loads = [DiskLoad(a.block_hash, 4)]
    store.place(cache, loads, store.read(loads))  # a is the most recently used now
    assert torch.equal(cache[:, :, 4], host[:, :, 0])
    assert store.listing() == (b, c, a)
    store.delete_and_write(host, host[:, :, 1:], [b.block_hash], [DiskWrite(3, d, from_device=True)])
    assert torch.equal(read_block_file(store.path(d.block_hash), fingerprint())[0], host[:, :, 4])  # device block 3
    bad = store.path(c.block_hash)
    bad.write_bytes(bad.read_bytes()[:-1] + b"\0")  # corrupt c
    store.close()  # a restart: a new worker with a smaller cap
    restarted = DiskStore(tmp_path, fingerprint(), capacity=1)
    assert restarted.listing() == (d,)  # c refused, a trimmed
    assert not bad.exists() and not store.path(a.block_hash).exists()
    # Another model's store in the same directory sees none of these files.
    assert DiskStore(tmp_path, fingerprint("/models/b"), capacity=3).listing() == ()


def test_a_refused_load_deletes_the_file_and_fails_the_step(tmp_path):
    store = DiskStore(tmp_path, fingerprint(), capacity=2)
    (a,) = blocks(1)
    store.delete_and_write(raw_view(torch.randn(2, 2, 1, 4, 3, 8)), None, [], [DiskWrite(0, a)])
    path = store.path(a.block_hash)
    path.write_bytes(path.read_bytes()[:-1] + b"\1")
    cache = torch.zeros(2, 2, 2, 4, 3, 8, dtype=torch.int32)
    with pytest.raises(BlockFileRefused, match="checksum"):
        loads = [DiskLoad(a.block_hash, 1)]
        store.place(cache, loads, store.read(loads))
    assert not path.exists() and not cache.any()


def test_one_live_store_per_folder(tmp_path):
    store = DiskStore(tmp_path, fingerprint(), capacity=2)
    with pytest.raises(ValueError, match="another worker"):
        DiskStore(tmp_path, fingerprint(), capacity=2)
    DiskStore(tmp_path, fingerprint("/models/b"), capacity=2).close()  # another model's folder: fine
    store.close()
    DiskStore(tmp_path, fingerprint(), capacity=2).close()


def test_the_cap_counts_each_file_with_its_header():
    assert num_disk_blocks(1 / 1024, 64 * 1024) == (1 << 20) // (64 * 1024 + 4096) == 15
    with pytest.raises(ValueError, match="kv-offload-dir-size"):
        DiskStore("/tmp", "f" * 64, capacity=0)


def test_plans_with_disk_operations_are_validated():
    from pagoda.contract.errors import PlanError
    from pagoda.contract.step import BlockCopy, StepPlan
    from worker_svc.plan_validation import validate_plan

    (a,) = blocks(1)
    ok = StepPlan(1, disk_deletes=[a.block_hash], disk_writes=[DiskWrite(2, a), DiskWrite(7, a, from_device=True)],
                  disk_loads=[DiskLoad(a.block_hash, 5)])
    validate_plan(ok, {}, num_blocks=8, block_size=4, num_cpu_blocks=3, has_disk_tier=True)
    for plan, error in ((ok, "no disk tier"),
                        (StepPlan(1, disk_writes=[DiskWrite(3, a)]), "disk write source"),
                        (StepPlan(1, disk_writes=[DiskWrite(8, a, from_device=True)]), "disk write source"),
                        (StepPlan(1, disk_loads=[DiskLoad(a.block_hash, 8)]), "disk load destination"),
                        (StepPlan(1, disk_loads=[DiskLoad(a.block_hash, 5)], swap_in=[BlockCopy(0, 5)]),
                         "write one device block twice")):
        with pytest.raises(PlanError, match=error):
            validate_plan(plan, {}, num_blocks=8, block_size=4, num_cpu_blocks=3, has_disk_tier=plan is not ok)
