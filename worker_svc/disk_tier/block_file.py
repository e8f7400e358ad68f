"""One prefix block on disk: a safetensors file with every layer's K and V of the block, and metadata
that says what it is and proves it is intact.

- Tensor `kv`: [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], stored as the same-size
  integer view of the cache dtype (bit-exact for every dtype, FP8 included; the dtype is in the
  fingerprint).
- Metadata: `format`, `fingerprint` (the model and cache layout the bytes belong to: a file from
  another model, dtype, block size or shape is refused, never served), `block_hash`, `token_ids`
  and `extra_keys` (what the scheduler verifies a hit against), and `sha256` over the payload and
  those three fields (a flipped bit anywhere is refused).

Written to a temporary name and renamed into place, so a crash mid-write leaves no half file
under a block's name. The same bytes travel between workers in live migration over gRPC
(`block_bytes` / `read_block_bytes`, worker_svc/kv_transfer/), verified the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load, save, save_file

from pagoda.contract.prefix_hash import extra_keys_from_json, extra_keys_to_json
from pagoda.contract.step import DiskBlock

FORMAT = "pagoda-kv-block/1"
SUFFIX = ".safetensors"
# What the size cap counts for a file besides its payload: the safetensors header with its metadata
# (about 1 KiB for a 16-token block) and the file system's rounding.
FILE_OVERHEAD_BYTES = 4096


class BlockFileRefused(Exception):
    """A block file that must not be served: unreadable, corrupt, or another model's."""


def model_fingerprint(model: str, dtype: torch.dtype, cache_dtype: torch.dtype, quantization: str,
                      block_size: int, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    """SHA-256 over what the KV bytes depend on: the model (its resolved path, config.json and the
    weight files' names and sizes; a GGUF file's size), the compute and cache dtypes, the weight
    quantization, and the cache block's layout."""
    path = Path(model).resolve()
    identity: dict = {"format": FORMAT, "model": str(path), "dtype": str(dtype), "kv_cache_dtype": str(cache_dtype),
                      "quantization": quantization, "block_size": block_size, "num_layers": num_layers,
                      "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    if path.is_dir():
        config = path / "config.json"
        identity["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else ""
        identity["weights"] = sorted((p.name, p.stat().st_size) for p in path.iterdir()
                                     if p.suffix in (".safetensors", ".bin", ".gguf"))
    elif path.exists():
        identity["size"] = path.stat().st_size
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _checksum(payload: torch.Tensor, block_hash: str, token_ids: str, extra_keys: str) -> str:
    digest = hashlib.sha256(memoryview(payload.numpy()).cast("B"))
    for field in (block_hash, token_ids, extra_keys):
        digest.update(b"\0" + field.encode())
    return digest.hexdigest()


def _metadata(payload: torch.Tensor, block: DiskBlock, fingerprint: str) -> dict[str, str]:
    fields = (block.block_hash.hex(), json.dumps(list(block.token_ids)), extra_keys_to_json(block.extra_keys))
    return {"format": FORMAT, "fingerprint": fingerprint, "block_hash": fields[0], "token_ids": fields[1],
            "extra_keys": fields[2], "sha256": _checksum(payload, *fields)}


def write_block_file(path: Path, payload: torch.Tensor, block: DiskBlock, fingerprint: str) -> None:
    """`payload`: the block's raw (integer view) K and V, [num_layers, 2, block_size, H, D], on CPU."""
    payload = payload.contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file({"kv": payload}, str(tmp), metadata=_metadata(payload, block, fingerprint))
    os.replace(tmp, path)


def block_bytes(payload: torch.Tensor, block: DiskBlock, fingerprint: str) -> bytes:
    """What `write_block_file` would write, as bytes (a block sent to another worker)."""
    payload = payload.contiguous()
    return save({"kv": payload}, metadata=_metadata(payload, block, fingerprint))


def read_block_bytes(data: bytes, fingerprint: str) -> tuple[torch.Tensor, DiskBlock]:
    """`read_block_file` for bytes `block_bytes` made: the same checks but the file's name."""
    try:
        size = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + size]).get("__metadata__") or {}
        payload = load(data)["kv"]
    except Exception as error:  # noqa: BLE001 - any unreadable block is refused the same way
        raise BlockFileRefused(f"unreadable: {error}") from error
    return payload, _verified(meta, payload, fingerprint)


def read_block_file(path: Path, fingerprint: str) -> tuple[torch.Tensor, DiskBlock]:
    """The payload and the block a file holds; BlockFileRefused unless its format, fingerprint,
    name and checksum all hold."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            payload = f.get_tensor("kv")
    except Exception as error:  # noqa: BLE001 - any unreadable file is refused the same way
        raise BlockFileRefused(f"unreadable: {error}") from error
    return payload, _verified(meta, payload, fingerprint, path.name)


def _verified(meta: dict, payload: torch.Tensor, fingerprint: str, name: str | None = None) -> DiskBlock:
    """The block `meta` describes; BlockFileRefused unless format, fingerprint, file name (when
    read from a file) and checksum hold."""
    if meta.get("format") != FORMAT:
        raise BlockFileRefused(f"format {meta.get('format')!r}, not {FORMAT}")
    if meta.get("fingerprint") != fingerprint:
        raise BlockFileRefused("another model's block (fingerprint differs)")
    fields = (meta.get("block_hash", ""), meta.get("token_ids", ""), meta.get("extra_keys", ""))
    if name is not None and name != fields[0] + SUFFIX:
        raise BlockFileRefused(f"named {name} but holds block {fields[0][:16]}")
    if meta.get("sha256") != _checksum(payload, *fields):
        raise BlockFileRefused("checksum mismatch")
    try:
        return DiskBlock(bytes.fromhex(fields[0]), tuple(json.loads(fields[1])), extra_keys_from_json(fields[2]))
    except ValueError as error:
        raise BlockFileRefused(f"bad metadata: {error}") from error
