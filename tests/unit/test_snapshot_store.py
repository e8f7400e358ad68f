"""The worker's session snapshot folder (worker_svc/disk_tier/snapshots.py) on a small raw cache: a
save writes one block file per block with its tokens, a new save replaces the folder whole, a save
that cannot write leaves the old snapshot and fails alone (logged), a restore's import reads the
files back bit for bit and keeps them, and the folder of each kind is checked before a plan runs."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.contract.errors import PlanError, SessionNotFoundError
from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.step import KvExport, KvImport
from worker_svc.disk_tier.snapshots import KvFiles, SnapshotStore

NAME = "0123456789abcdef0123456789abcdef"


def cache() -> torch.Tensor:
    """[layers 2, K/V, 4 blocks, 2 slots, 1 head, 3 dims] of distinct values."""
    return torch.arange(2 * 2 * 4 * 2 * 1 * 3, dtype=torch.float32).reshape(2, 2, 4, 2, 1, 3)


def save(blocks: list[int], tokens: tuple[int, ...]) -> KvExport:
    return KvExport(RequestId(""), NAME, [BlockId(b) for b in blocks], len(tokens), snapshot=True, token_ids=tokens)


def test_a_snapshot_is_saved_replaced_whole_and_read_back_bit_for_bit(tmp_path):
    store = SnapshotStore(tmp_path, "fingerprint", block_size=2)
    with pytest.raises(SessionNotFoundError):
        store.listing(NAME)
    source = cache()
    store.export(source, [save([3, 1, 2], (5, 6, 7, 8, 9, 10))], {})
    tokens, num_blocks, num_bytes = store.listing(NAME)
    assert (tokens, num_blocks) == ([5, 6, 7, 8, 9, 10], 3)
    assert num_bytes == sum(p.stat().st_size for p in (tmp_path / NAME).iterdir())

    target = torch.zeros_like(source)
    load = KvImport(RequestId("r"), NAME, 1, [BlockId(0), BlockId(2)], 6, snapshot=True)
    files = KvFiles(None, store)
    files.place(target, [load], files.read([load], {"r": [5, 6, 7, 8, 9, 10, 11]}))
    assert torch.equal(target[:, :, 0], source[:, :, 1]) and torch.equal(target[:, :, 2], source[:, :, 2])
    assert store.listing(NAME)[1] == 3  # a restore keeps the snapshot

    store.export(source, [save([0], (1, 2))], {})  # the session saved again, shorter: the old files go
    assert store.listing(NAME)[:2] == ([1, 2], 1)


def test_a_save_that_cannot_write_fails_alone_and_keeps_the_old_snapshot(tmp_path):
    store = SnapshotStore(tmp_path, "fingerprint", block_size=2)
    store.export(cache(), [save([1], (5, 6))], {})
    (tmp_path / f".{NAME}.{os.getpid()}.tmp").write_text("in the way")  # its working folder cannot be made
    store.export(cache(), [save([2, 3], (7, 8, 9, 10))], {})
    assert store.listing(NAME)[:2] == ([5, 6], 1)


def test_each_kind_needs_its_folder_and_a_safe_name(tmp_path):
    with pytest.raises(PlanError, match="--kv-snapshot-dir"):
        KvFiles(None, None).check([save([1], (5, 6))], [])
    files = KvFiles(None, SnapshotStore(tmp_path, "fingerprint", block_size=2))
    with pytest.raises(PlanError, match="--kv-migrate-dir"):
        files.check([KvExport(RequestId("a"), "m1", [BlockId(1)], 2)], [])
    with pytest.raises(PlanError, match="bad migration id"):
        files.check([KvExport(RequestId(""), "../up", [BlockId(1)], 2, snapshot=True, token_ids=(5, 6))], [])
