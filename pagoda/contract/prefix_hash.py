"""The chained prefix-block hash, shared by the scheduler's prefix index and the gateway's router.

hash_i = SHA-256(hash_{i-1} or ROOT, token ids of full block i, extra keys), where the extra keys
carry the per-request `cache_salt` and LoRA adapter (`LoRARequest.cache_key`) on the first block (the
chain carries them to every later block): K/V computed under one adapter is never a hit for another.
The gateway routes a request by the same hash the scheduler caches it under, so two requests that
would share cached blocks on one replica are sent to that replica. Pure: hashlib and struct only.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence

from pagoda.contract.multimodal import mm_block_keys

ROOT_HASH = hashlib.sha256(b"pagoda/prefix-root/v1").digest()

_packers: dict[int, Callable[..., bytes]] = {}  # block length -> struct packer of that many int64s


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """The token ids as native int64s: the bytes array("q", ...).tobytes() gives, at half the cost
    (a precompiled struct per block length; a block fills on every block_size-th decode step)."""
    pack = _packers.get(len(token_ids))
    if pack is None:
        pack = _packers[len(token_ids)] = struct.Struct(f"{len(token_ids)}q").pack
    return pack(*token_ids)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """SHA-256 over (parent hash, tokens as fixed-width ints, extra keys)."""
    digest = hashlib.sha256(parent or ROOT_HASH)
    digest.update(_pack_tokens(token_ids))
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def block_extra_keys(block_index: int, cache_salt: str | None, lora_key: str | None = None,
                     mm_keys: tuple = ()) -> tuple:
    """`mm_keys`: ("mm", image hash) of the images overlapping this block (multimodal.mm_block_keys)."""
    if block_index:
        return mm_keys
    keys = () if cache_salt is None else (cache_salt,)
    # Tagged, so an adapter key can never equal a salt; without an adapter the keys are unchanged.
    keys = keys if lora_key is None else (*keys, ("lora", lora_key))
    return (*keys, *mm_keys) if mm_keys else keys


def prefix_hash(token_ids: Sequence[int], block_size: int, cache_salt: str | None,
                max_blocks: int, lora_key: str | None = None, mm_inputs: Sequence = ()) -> bytes | None:
    """The chained hash of the first min(max_blocks, full blocks) blocks: the scheduler's hash of
    that block (`mm_inputs`: the prompt's images, keyed as the scheduler keys them). None when the
    prompt has no full block (nothing could be cached for it)."""
    parent = None
    for i in range(min(max_blocks, len(token_ids) // block_size)):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                            block_extra_keys(i, cache_salt, lora_key, mm_block_keys(mm_inputs, i, block_size)))
    return parent


def extra_keys_to_json(extra_keys: tuple) -> str:
    """A block's extra keys (strings and ("lora", key) pairs) as JSON: the disk tier keeps them."""
    return json.dumps(extra_keys)


def extra_keys_from_json(text: str) -> tuple:
    """The inverse of extra_keys_to_json: JSON lists back to the tuples the hash was taken over."""
    def as_tuple(value):
        return tuple(as_tuple(v) for v in value) if isinstance(value, list) else value
    return as_tuple(json.loads(text)) if text else ()
