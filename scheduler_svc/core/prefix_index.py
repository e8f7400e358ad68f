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

import struct
from array import array
from collections.abc import Callable, Sequence

from pagoda.contract.ids import BlockId

# The hash itself lives in the contract: the gateway's prefix-aware router computes the same one.
# kv_cache_manager calls it as `prefix_index.hash_block`, so tests can monkeypatch it here.
from pagoda.contract.prefix_hash import ROOT_HASH, block_extra_keys, hash_block  # noqa: F401

ROOT_SERIAL = 0  # the parent serial of a first block


# What `remove` returns for an evicted block (the host tier keeps it): (block_hash, parent_serial,
# packed token ids, extra_keys, serial). Built on eviction only: the index itself keeps its entries
# as columns (below), not as one tuple per cached block.
_Entry = tuple[bytes, int, bytes, tuple, int]

# Memory (docs/reliability.md, "RSS flat in one run"): a cached block outlives its request, and the
# scheduler's RSS grew with every block the index kept until the pool was full: ~0.9 KiB each when
# an entry was a tuple holding its token ids as a tuple of ints (each id past the small-int cache
# its own 32-byte object, kept alive). Now an entry is the block's slot in per-block columns sized
# once to the pool: the token ids packed 4 bytes each (`pack_tokens`: one 97-byte bytes object for
# 16 ids; token ids are uint32 on the wire and within the vocabulary), the serials as int64s
# (no int objects), the hash and the extra keys (usually the shared empty tuple) by reference.
_packers: dict[int, Callable[..., bytes]] = {}  # block length -> struct packer of that many uint32s


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """A block's token ids as native uint32s: what entries store and hits are compared against."""
    pack = _packers.get(len(token_ids))
    if pack is None:
        pack = _packers[len(token_ids)] = struct.Struct(f"{len(token_ids)}I").pack
    return pack(*token_ids)


def unpack_tokens(packed: bytes) -> tuple[int, ...]:
    """The inverse of pack_tokens (the disk tier's files carry the ids themselves)."""
    return struct.unpack(f"{len(packed) // 4}I", packed)


class PrefixIndex:
    __slots__ = ("_by_hash", "_hash", "_tokens", "_keys", "_parent", "_serial", "_next_serial",
                 "num_collisions")

    def __init__(self, num_blocks: int = 0) -> None:
        self._by_hash: dict[bytes, BlockId] = {}  # one hash per entry: its size is the index's
        # The entries, by block id (BlockPool calls `reserve` with its size): None / 0 where the
        # block is not cached.
        self._hash: list[bytes | None] = []
        self._tokens: list[bytes | None] = []
        self._keys: list[tuple] = []
        self._parent = array("q")  # the parent entry's serial
        self._serial = array("q")
        self.reserve(num_blocks)
        self._next_serial = ROOT_SERIAL + 1
        self.num_collisions = 0  # hash matches rejected by token / parent / key verification

    def reserve(self, num_blocks: int) -> None:
        """Room for block ids < num_blocks (the pool's)."""
        more = num_blocks - len(self._hash)
        if more > 0:
            self._hash.extend([None] * more)
            self._tokens.extend([None] * more)
            self._keys.extend([()] * more)
            self._parent.extend(array("q", [0]) * more)
            self._serial.extend(array("q", [0]) * more)

    def __len__(self) -> int:
        return len(self._by_hash)

    def is_cached(self, block: BlockId) -> bool:
        # (NULL_BLOCK is -1: a window-freed table entry is never cached, nor the last block)
        return 0 <= block < len(self._hash) and self._hash[block] is not None

    def serial_of(self, block: BlockId) -> int:
        return self._serial[block]

    def match(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
              cache_salt: str | None, max_blocks: int, lora_key: str | None = None,
              keys_of: Callable[[int, int], tuple] | None = None) -> tuple[list[BlockId], int]:
        """The longest verified chain of cached blocks (at most max_blocks) and its last serial.
        `keys_of(i, block_size)`: block i's extra keys (Request.block_keys: salt, adapter, images);
        None: from cache_salt and lora_key alone."""
        if keys_of is None:
            def keys_of(i: int, _bs: int) -> tuple:
                return block_extra_keys(i, cache_salt, lora_key)
        blocks: list[BlockId] = []
        serial = ROOT_SERIAL
        for i in range(max_blocks):
            block = self._by_hash.get(block_hashes[i])
            if block is None:
                break
            if self._parent[block] != serial \
                    or self._tokens[block] != pack_tokens(token_ids[i * block_size:(i + 1) * block_size]) \
                    or self._keys[block] != keys_of(i, block_size):
                self.num_collisions += 1
                break
            blocks.append(block)
            serial = self._serial[block]
        return blocks, serial

    def register(self, block: BlockId, block_hash: bytes, parent_serial: int,
                 token_ids: Sequence[int], extra_keys: tuple) -> int | None:
        """Register a computed full block; return the serial now holding this content.

        When another block already holds the same content, that entry's serial is returned and
        `block` stays unregistered (no de-duplication: tables are append-only). None on a collision.
        """
        packed = pack_tokens(token_ids)
        holder = self._by_hash.get(block_hash)
        if holder is not None:
            if self._parent[holder] == parent_serial and self._tokens[holder] == packed \
                    and self._keys[holder] == extra_keys:
                return self._serial[holder]
            self.num_collisions += 1
            return None
        if block >= len(self._hash):  # an index without a pool (tests)
            self.reserve(block + 1)
        if self._hash[block] is not None:
            raise AssertionError(f"block {block} registered twice")
        serial = self._next_serial
        self._next_serial += 1
        self._hash[block], self._tokens[block], self._keys[block] = block_hash, packed, extra_keys
        self._parent[block], self._serial[block] = parent_serial, serial
        self._by_hash[block_hash] = block
        return serial

    def remove(self, block: BlockId) -> _Entry:
        """Forget a block (it is being evicted and reused); its entry (the host tier keeps it)."""
        block_hash, tokens = self._hash[block], self._tokens[block]
        assert block_hash is not None and tokens is not None, f"block {block} is not in the prefix index"
        entry = (block_hash, self._parent[block], tokens, self._keys[block], self._serial[block])
        self._hash[block] = self._tokens[block] = None
        self._keys[block] = ()
        if self._by_hash.get(block_hash) == block:
            del self._by_hash[block_hash]
        return entry

    def purge(self) -> None:
        """Forget everything (worker restart: the cache contents are gone). Serials stay unique."""
        self._by_hash.clear()
        n = len(self._hash)
        # In place: the columns may be in the collector's permanent generation (gc.freeze).
        self._hash[:] = [None] * n
        self._tokens[:] = [None] * n
        self._keys[:] = [()] * n
