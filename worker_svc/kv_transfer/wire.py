"""How an export's blocks travel on KvTransfer.FetchKv: each block is the bytes of a block file
(worker_svc/disk_tier/block_file.py: the model fingerprint and a checksum in its metadata), cut into
pieces and packed in order into messages of at most `chunk_bytes` of data, so every message stays
under gRPC's 4 MiB default whatever the block size (a 70B model's block is ~5 MiB).

`chunks` cuts; `Assembler` puts the pieces back together and refuses anything but the exact
sequence `chunks` makes (block 0 first, every piece at the offset that follows the last, sizes that
agree, every block complete and no more than announced), so a truncated, reordered or padded stream
is an error, never a silently wrong block. Checksums are the block files' own (read_block_bytes).

Plain tuples here, with the field names of the KvChunk / KvPiece messages (the servicer converts;
the Assembler reads either): the runner's modules import this, and never the generated protos.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

CHUNK_BYTES = 1 << 20  # data per message: a quarter of gRPC's 4 MiB default receive limit


class TransferRefused(Exception):
    """A FetchKv stream that does not hold exactly the blocks it announced."""


class Piece(NamedTuple):  # KvPiece
    index: int
    offset: int
    size: int
    data: bytes


class Chunk(NamedTuple):  # KvChunk
    pieces: list[Piece]
    num_blocks: int


def chunks(blocks: Iterable[bytes], num_blocks: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """`blocks`: the export's block bytes in index order (may be a lazy iterator: one block is
    serialised at a time). Every message but the last carries exactly `chunk_bytes` of data."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    pieces: list[Piece] = []
    room = chunk_bytes
    for index, data in enumerate(blocks):
        view = memoryview(data)
        offset = 0
        while True:
            take = min(room, len(view) - offset)
            pieces.append(Piece(index, offset, len(view), bytes(view[offset:offset + take])))
            offset += take
            room -= take
            if room == 0:
                yield Chunk(pieces, num_blocks)
                pieces, room = [], chunk_bytes
            if offset >= len(view):
                break
    if pieces or num_blocks == 0:
        yield Chunk(pieces, num_blocks)


class Assembler:
    """Feed it a stream's chunks in order; it returns each block's bytes as the block completes."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks  # what the handoff promised
        self.num_bytes = 0
        self._index = 0  # the block being assembled
        self._parts: list[bytes] = []
        self._have = 0
        self._size: int | None = None

    def feed(self, chunk: Chunk) -> list[bytes]:
        """`chunk`: a Chunk or a KvChunk message (the same fields)."""
        if chunk.num_blocks != self.num_blocks:
            raise TransferRefused(f"the source holds {chunk.num_blocks} blocks, the handoff said {self.num_blocks}")
        done = []
        for piece in chunk.pieces:
            if piece.index != self._index or piece.offset != self._have or self._index >= self.num_blocks:
                raise TransferRefused(f"piece of block {piece.index} at {piece.offset}, expected block "
                                      f"{self._index} at {self._have}")
            if self._size is None:
                self._size = piece.size
            if piece.size != self._size or self._have + len(piece.data) > self._size:
                raise TransferRefused(f"block {piece.index}: pieces disagree on its size")
            self._parts.append(piece.data)
            self._have += len(piece.data)
            self.num_bytes += len(piece.data)
            if self._have == self._size:
                done.append(b"".join(self._parts))
                self._index, self._parts, self._have, self._size = self._index + 1, [], 0, None
        return done

    def finish(self) -> None:
        """The stream ended: every announced block must be complete."""
        if self._index != self.num_blocks:
            raise TransferRefused(f"the stream ended after {self._index} of {self.num_blocks} blocks")
