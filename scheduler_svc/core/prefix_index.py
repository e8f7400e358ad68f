"""The prefix index: chained SHA-256 block hashes -> physical blocks, every hit verified.

hash_i = SHA-256(hash_{i-1} or ROOT, token ids of full block i, extra keys) where the extra keys
carry the per-request `cache_salt` on the first block (the chain carries it to every later block).
A hash match alone is never trusted: the entry also stores the block's token ids, its extra keys
and the serial of its parent entry, and a hit must match all three, so a collision (even a crafted
one) degrades to a miss. Serials are never reused, so an entry whose parent was evicted and
re-registered elsewhere cannot be reached through the new parent.

Only the scheduler registers blocks, and only once the step that wrote them has reported.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from scheduler_svc.core.params import BlockId

ROOT_HASH = hashlib.sha256(b"pagoda/prefix-root/v1").digest()
ROOT_SERIAL = 0  # the parent serial of a first block


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """SHA-256 over (parent hash, tokens as fixed-width ints, extra keys). Tests monkeypatch this."""
    digest = hashlib.sha256(parent or ROOT_HASH)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple:
    return (cache_salt,) if block_index == 0 and cache_salt is not None else ()


class _Entry:
    __slots__ = ("block_hash", "parent_serial", "token_ids", "extra_keys", "serial")

    def __init__(self, block_hash: bytes, parent_serial: int, token_ids: tuple[int, ...],
                 extra_keys: tuple, serial: int) -> None:
        self.block_hash = block_hash
        self.parent_serial = parent_serial
        self.token_ids = token_ids
        self.extra_keys = extra_keys
        self.serial = serial

    def matches(self, parent_serial: int, token_ids: tuple[int, ...], extra_keys: tuple) -> bool:
        return (self.parent_serial == parent_serial and self.token_ids == token_ids
                and self.extra_keys == extra_keys)


class PrefixIndex:
    __slots__ = ("_by_hash", "_entries", "_next_serial", "num_collisions")

    def __init__(self) -> None:
        self._by_hash: dict[bytes, BlockId] = {}
        self._entries: dict[BlockId, _Entry] = {}
        self._next_serial = ROOT_SERIAL + 1
        self.num_collisions = 0  # hash matches rejected by token / parent / key verification

    def __len__(self) -> int:
        return len(self._entries)

    def is_cached(self, block: BlockId) -> bool:
        return block in self._entries

    def serial_of(self, block: BlockId) -> int:
        return self._entries[block].serial

    def match(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
              cache_salt: str | None, max_blocks: int) -> tuple[list[BlockId], int]:
        """The longest verified chain of cached blocks (at most max_blocks) and its last serial."""
        blocks: list[BlockId] = []
        serial = ROOT_SERIAL
        for i in range(max_blocks):
            block = self._by_hash.get(block_hashes[i])
            if block is None:
                break
            entry = self._entries[block]
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            if not entry.matches(serial, tokens, block_extra_keys(i, cache_salt)):
                self.num_collisions += 1
                break
            blocks.append(block)
            serial = entry.serial
        return blocks, serial

    def register(self, block: BlockId, block_hash: bytes, parent_serial: int,
                 token_ids: tuple[int, ...], extra_keys: tuple) -> int | None:
        """Register a computed full block; return the serial now holding this content.

        When another block already holds the same content, that entry's serial is returned and
        `block` stays unregistered (no de-duplication: tables are append-only). None on a collision.
        """
        holder = self._by_hash.get(block_hash)
        if holder is not None:
            entry = self._entries[holder]
            if entry.matches(parent_serial, token_ids, extra_keys):
                return entry.serial
            self.num_collisions += 1
            return None
        if block in self._entries:
            raise AssertionError(f"block {block} registered twice")
        serial = self._next_serial
        self._next_serial += 1
        self._entries[block] = _Entry(block_hash, parent_serial, token_ids, extra_keys, serial)
        self._by_hash[block_hash] = block
        return serial

    def remove(self, block: BlockId) -> None:
        """Forget a block (it is being evicted and reused)."""
        entry = self._entries.pop(block)
        if self._by_hash.get(entry.block_hash) == block:
            del self._by_hash[entry.block_hash]

    def purge(self) -> None:
        """Forget everything (worker restart: the cache contents are gone). Serials stay unique."""
        self._by_hash.clear()
        self._entries.clear()
