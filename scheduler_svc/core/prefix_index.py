"""The prefix index: chained SHA-256 block hashes -> physical blocks, every hit verified.

hash_i = SHA-256(hash_{i-1} or ROOT, token ids of full block i, extra keys) where the extra keys
carry the per-request `cache_salt` and LoRA adapter on the first block (the chain carries them on).
A hash match alone is never trusted: the entry also stores the block's token ids, its extra keys
and the serial of its parent entry, and a hit must match all three, so a collision (even a crafted
one) degrades to a miss. Serials are never reused, so an entry whose parent was evicted and
re-registered elsewhere cannot be reached through the new parent.

Only the scheduler registers blocks, and only once the step that wrote them has reported.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.contract.ids import BlockId

# The hash itself lives in the contract: the gateway's prefix-aware router computes the same one.
# kv_cache_manager calls it as `prefix_index.hash_block`, so tests can monkeypatch it here.
from pagoda.contract.prefix_hash import ROOT_HASH, block_extra_keys, hash_block  # noqa: F401

ROOT_SERIAL = 0  # the parent serial of a first block


# An entry, per cached block: (block_hash, parent_serial, token_ids, extra_keys, serial). A plain
# tuple of hashable atoms, not an object: cheaper to build (one per filled block) and, unlike a
# slotted object, untracked by the cyclic GC, which otherwise walks all num_blocks entries.
_Entry = tuple[bytes, int, tuple[int, ...], tuple, int]
_HASH, _SERIAL = 0, 4


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
        return self._entries[block][_SERIAL]

    def match(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
              cache_salt: str | None, max_blocks: int,
              lora_key: str | None = None) -> tuple[list[BlockId], int]:
        """The longest verified chain of cached blocks (at most max_blocks) and its last serial."""
        blocks: list[BlockId] = []
        serial = ROOT_SERIAL
        for i in range(max_blocks):
            block = self._by_hash.get(block_hashes[i])
            if block is None:
                break
            _, parent, tokens, extra_keys, entry_serial = self._entries[block]
            if parent != serial or tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]) \
                    or extra_keys != block_extra_keys(i, cache_salt, lora_key):
                self.num_collisions += 1
                break
            blocks.append(block)
            serial = entry_serial
        return blocks, serial

    def register(self, block: BlockId, block_hash: bytes, parent_serial: int,
                 token_ids: tuple[int, ...], extra_keys: tuple) -> int | None:
        """Register a computed full block; return the serial now holding this content.

        When another block already holds the same content, that entry's serial is returned and
        `block` stays unregistered (no de-duplication: tables are append-only). None on a collision.
        """
        holder = self._by_hash.get(block_hash)
        if holder is not None:
            _, parent, tokens, keys, serial = self._entries[holder]
            if parent == parent_serial and tokens == token_ids and keys == extra_keys:
                return serial
            self.num_collisions += 1
            return None
        if block in self._entries:
            raise AssertionError(f"block {block} registered twice")
        serial = self._next_serial
        self._next_serial += 1
        self._entries[block] = (block_hash, parent_serial, token_ids, extra_keys, serial)
        self._by_hash[block_hash] = block
        return serial

    def remove(self, block: BlockId) -> _Entry:
        """Forget a block (it is being evicted and reused); its entry (the host tier keeps it)."""
        entry = self._entries.pop(block)
        block_hash = entry[_HASH]
        if self._by_hash.get(block_hash) == block:
            del self._by_hash[block_hash]
        return entry

    def purge(self) -> None:
        """Forget everything (worker restart: the cache contents are gone). Serials stay unique."""
        self._by_hash.clear()
        self._entries.clear()
