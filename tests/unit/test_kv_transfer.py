"""Live migration over gRPC, the pieces without a network (worker_svc/kv_transfer/): blocks cut into
messages that stay under gRPC's 4 MiB default and put back together bit for bit, a stream that is
truncated, reordered, padded or about other blocks refused; a block's bytes verified as a block
file is (fingerprint, checksum); the source's outbox bounded by bytes and TTL, and dropped once
fetched; the target's inbox verifying, staging, checking tokens at the load and placing the blocks."""

from __future__ import annotations

import random

import grpc
import pytest
import torch

from pagoda.contract.errors import PlanError
from pagoda.contract.step import DiskBlock, KvExport, KvImport
from pagoda.v1 import kv_transfer_pb2
from worker_svc.disk_tier.block_file import BlockFileRefused, block_bytes, model_fingerprint, read_block_bytes
from worker_svc.kv_transfer.inbox import KvInbox, PullFailed
from worker_svc.kv_transfer.outbox import ExportNotFound, ForeignFingerprint, KvOutbox
from worker_svc.kv_transfer.wire import Assembler, Chunk, Piece, TransferRefused, chunks

BS = 4
CACHE_SHAPE = (2, 2, 16, BS, 3, 8)  # [layers, K/V, num_blocks, block_size, kv heads, head_dim]
FP = model_fingerprint("/models/a", torch.float32, torch.float32, "auto", BS, 2, 3, 8)
GRPC_DEFAULT_LIMIT = 4 << 20


def _pb(chunk: Chunk) -> kv_transfer_pb2.KvChunk:
    return kv_transfer_pb2.KvChunk(pieces=[kv_transfer_pb2.KvPiece(index=p.index, offset=p.offset, size=p.size,
                                                                   data=p.data) for p in chunk.pieces],
                                   num_blocks=chunk.num_blocks)


@pytest.mark.parametrize("sizes", [[700_000] * 5, [5 << 20, 3, 1 << 20, 2_000_000], [10] * 300, [1]])
def test_chunks_stay_under_the_default_limit_and_reassemble_bit_for_bit(sizes):
    rng = random.Random(len(sizes))
    blocks = [rng.randbytes(n) for n in sizes]
    assembler, out = Assembler(len(blocks)), []
    for chunk in chunks(iter(blocks), len(blocks)):
        message = _pb(chunk)
        assert message.ByteSize() < GRPC_DEFAULT_LIMIT
        out += assembler.feed(kv_transfer_pb2.KvChunk.FromString(message.SerializeToString()))  # over the wire
    assembler.finish()
    assert out == blocks and assembler.num_bytes == sum(sizes)


def test_small_blocks_share_messages_and_full_messages_are_exactly_the_chunk_size():
    blocks = [bytes([i]) * 300 for i in range(10)]
    messages = list(chunks(blocks, 10, chunk_bytes=1000))
    assert [sum(len(p.data) for p in m.pieces) for m in messages] == [1000, 1000, 1000]
    assert [p.index for p in messages[0].pieces] == [0, 1, 2, 3]  # block 3 is cut: 100 here, 200 next
    assert (messages[0].pieces[-1].offset, messages[1].pieces[0].offset) == (0, 100)


def test_a_stream_that_is_not_exactly_the_export_is_refused():
    blocks = [b"a" * 10, b"b" * 10]
    good = list(chunks(blocks, 2, chunk_bytes=6))
    with pytest.raises(TransferRefused, match="ended after 1 of 2"):  # truncated
        assembler = Assembler(2)
        for chunk in good[:2]:
            assembler.feed(chunk)
        assembler.finish()
    with pytest.raises(TransferRefused, match="expected block 0 at 6"):  # a piece lost in the middle
        assembler = Assembler(2)
        assembler.feed(good[0])
        assembler.feed(good[2])
    with pytest.raises(TransferRefused, match="handoff said 1"):  # more blocks than the handoff
        Assembler(1).feed(good[0])
    with pytest.raises(TransferRefused, match="expected block 2"):  # padded with an extra block
        assembler = Assembler(2)
        for chunk in good:
            assembler.feed(chunk)
        assembler.feed(Chunk([Piece(2, 0, 1, b"x")], 2))
    with pytest.raises(TransferRefused, match="disagree on its size"):
        Assembler(1).feed(Chunk([Piece(0, 0, 3, b"xxxx")], 1))


def test_block_bytes_are_verified_as_block_files_are():
    payload = torch.randint(-2**31, 2**31 - 1, (2, 2, BS, 3, 8), dtype=torch.int32)
    block = DiskBlock((7).to_bytes(4, "big"), (1, 2, 3, 4))
    data = block_bytes(payload, block, FP)
    loaded, got = read_block_bytes(data, FP)
    assert torch.equal(loaded, payload) and got == block
    with pytest.raises(BlockFileRefused, match="fingerprint"):
        read_block_bytes(data, FP.replace(FP[0], "0" if FP[0] != "0" else "1", 1))
    flipped = bytearray(data)
    flipped[-5] ^= 1  # a bit of the payload
    with pytest.raises(BlockFileRefused, match="checksum"):
        read_block_bytes(bytes(flipped), FP)
    with pytest.raises(BlockFileRefused, match="unreadable"):
        read_block_bytes(data[:100], FP)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cache() -> torch.Tensor:
    return torch.randn(CACHE_SHAPE)


TOKENS = {"r1": list(range(100, 111)), "r2": list(range(200, 208))}  # 11 tokens: 3 blocks; 8: 2


def _outbox(capacity: int = 1 << 30, clock=None) -> KvOutbox:
    return KvOutbox(FP, BS, capacity, ttl_s=60.0, **({"clock": clock} if clock else {}))


def test_the_outbox_serves_a_copy_of_the_blocks_and_drops_them_once_fetched():
    cache, outbox = _cache(), _outbox()
    outbox.export(cache, [KvExport("r1", "m1", [5, 2, 9], 11)], TOKENS)
    expected = cache[:, :, [5, 2, 9]].clone()
    cache.zero_()  # the plan's later operations reuse the blocks: the export kept its own copy
    num_blocks, blocks = outbox.open("m1", FP)
    decoded = [read_block_bytes(data, FP) for data in blocks]
    assert num_blocks == 3 and [b.token_ids for _, b in decoded] == [(100, 101, 102, 103), (104, 105, 106, 107),
                                                                    (108, 109, 110)]
    assert all(torch.equal(p, expected[:, :, i]) for i, (p, _) in enumerate(decoded))
    with pytest.raises(ForeignFingerprint):
        outbox.open("m1", "another")
    outbox.done("m1")
    with pytest.raises(ExportNotFound):
        outbox.open("m1", FP)


def test_the_outbox_is_bounded_by_bytes_and_by_its_ttl():
    clock = Clock()
    block_bytes_ = 2 * 2 * BS * 3 * 8 * 4
    outbox = _outbox(capacity=4 * block_bytes_, clock=clock)
    cache = _cache()
    outbox.export(cache, [KvExport("r1", "m1", [0, 1, 2], 11), KvExport("r2", "m2", [3, 4], 8)], TOKENS)
    assert outbox.held_bytes == 3 * block_bytes_ and outbox.num_dropped == 1  # m2 did not fit: not kept
    with pytest.raises(ExportNotFound):
        outbox.open("m2", FP)
    clock.now = 61.0
    with pytest.raises(ExportNotFound):  # expired
        outbox.open("m1", FP)
    outbox.export(cache, [KvExport("r2", "m2", [3, 4], 8)], TOKENS)  # the room came back
    assert outbox.open("m2", FP)[0] == 2


def _pull_from(outbox: KvOutbox, chunk_bytes: int = 1000):
    """A `fetch` that streams an outbox's export as FetchKv would, without a network."""
    def fetch(source, migration_id, timeout_s):
        try:
            num_blocks, blocks = outbox.open(migration_id, FP)
        except ExportNotFound as error:
            raise _RpcError(grpc.StatusCode.NOT_FOUND, str(error)) from None
        yield from (_pb(c) for c in chunks(blocks, num_blocks, chunk_bytes))
        outbox.done(migration_id)
    return fetch


class _RpcError(grpc.RpcError, grpc.Call):
    def __init__(self, code, details) -> None:
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def initial_metadata(self): ...
    def trailing_metadata(self): ...
    def is_active(self): ...
    def time_remaining(self): ...
    def cancel(self): ...
    def add_callback(self, callback): ...


def test_a_pulled_export_loads_into_the_target_blocks_after_its_tokens_are_checked():
    source_cache, outbox = _cache(), _outbox()
    outbox.export(source_cache, [KvExport("r1", "m1", [5, 2, 9], 11)], TOKENS)
    inbox = KvInbox(FP, BS, 1 << 30, ttl_s=60.0)
    num_blocks, num_bytes = inbox.pull("src:1", "m1", 3, 5.0, _pull_from(outbox))
    assert num_blocks == 3 and num_bytes > 3 * 2 * 2 * BS * 3 * 8 * 4 and inbox.holds("m1")
    continuation = TOKENS["r1"] + [111, 112]
    with pytest.raises(PlanError, match="other tokens"):
        inbox.read([KvImport("r9", "m1", 0, [1, 2, 3], 11)], {"r9": [0] * 13})
    load = KvImport("r9", "m1", 1, [7, 3], 11)  # block 0 was a prefix hit on the target
    payloads = inbox.read([load], {"r9": continuation})
    target = torch.zeros(CACHE_SHAPE)
    inbox.place(target, [load], payloads)
    assert torch.equal(target[:, :, 7], source_cache[:, :, 2]) and torch.equal(target[:, :, 3], source_cache[:, :, 9])
    assert not inbox.holds("m1")
    with pytest.raises(PlanError, match="not pulled"):
        inbox.read([load], {"r9": continuation})


def test_a_failed_pull_stages_nothing_and_says_why():
    inbox = KvInbox(FP, BS, 1 << 30, ttl_s=60.0)
    with pytest.raises(PullFailed) as failed:  # unknown / expired / fetched already
        inbox.pull("src:1", "nope", 3, 5.0, _pull_from(_outbox()))
    assert failed.value.code == grpc.StatusCode.NOT_FOUND

    outbox = _outbox()
    outbox.export(_cache(), [KvExport("r1", "m1", [5, 2, 9], 11)], TOKENS)
    with pytest.raises(PullFailed) as failed:  # the handoff promised more than the source holds
        inbox.pull("src:1", "m1", 4, 5.0, _pull_from(outbox))
    assert failed.value.code == grpc.StatusCode.DATA_LOSS

    outbox.export(_cache(), [KvExport("r1", "m2", [5, 2, 9], 11)], TOKENS)

    def tampered(source, migration_id, timeout_s):
        for message in _pull_from(outbox)(source, migration_id, timeout_s):
            for piece in message.pieces:
                piece.data = piece.data[:-1] + bytes([piece.data[-1] ^ 1])
            yield message
    with pytest.raises(PullFailed) as failed:
        inbox.pull("src:1", "m2", 3, 5.0, tampered)
    assert failed.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in str(failed.value)

    outbox.export(_cache(), [KvExport("r1", "m3", [5, 2, 9], 11)], TOKENS)
    small = KvInbox(FP, BS, 2 * 2 * 2 * BS * 3 * 8 * 4, ttl_s=60.0)  # room for 2 of the 3 blocks
    with pytest.raises(PullFailed) as failed:
        small.pull("src:1", "m3", 3, 5.0, _pull_from(outbox))
    assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not any(inbox.holds(m) or small.holds(m) for m in ("nope", "m1", "m2", "m3"))
    assert small._reserved == 0 and inbox._reserved == 0  # noqa: SLF001 - nothing stays reserved


def test_a_staged_import_nobody_loads_expires():
    clock, outbox = Clock(), _outbox()
    outbox.export(_cache(), [KvExport("r1", "m1", [5, 2, 9], 11), KvExport("r2", "m2", [1, 3], 8)], TOKENS)
    inbox = KvInbox(FP, BS, 1 << 30, ttl_s=60.0, clock=clock)
    inbox.pull("src:1", "m1", 3, 5.0, _pull_from(outbox))
    clock.now = 61.0
    inbox.pull("src:1", "m2", 2, 5.0, _pull_from(outbox))  # a pull sweeps the expired ones
    assert not inbox.holds("m1") and inbox.holds("m2")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_move_bit_for_bit_between_device_caches(device, dtype):
    from worker_svc.kv_cache import raw_view

    source = raw_view(torch.randn(CACHE_SHAPE).to(dtype).to(device))  # the runner's raw integer view
    outbox = _outbox()
    outbox.export(source, [KvExport("r1", "m1", [5, 2, 9], 11)], TOKENS)
    inbox = KvInbox(FP, BS, 1 << 30, ttl_s=60.0)
    inbox.pull("src:1", "m1", 3, 5.0, _pull_from(outbox, chunk_bytes=1 << 20))
    load = KvImport("r9", "m1", 0, [0, 1, 4], 11)
    target = torch.zeros_like(source)
    inbox.place(target, [load], inbox.read([load], {"r9": TOKENS["r1"]}))
    assert torch.equal(target[:, :, [0, 1, 4]], source[:, :, [5, 2, 9]])
