"""A GGUF file's metadata and tensor table, parsed in milliseconds (issue 47, item 4: start in about a second).

Why not `gguf.GGUFReader`: it builds numpy memmap views for every part of every field when it
opens, ~3 million of them for a 151k-token vocabulary and its merges (Qwen2.5), which took 20-80 s
of a worker's start on the 2-core machine, while the worker needs a dozen scalars and the tensor
table. This reader walks the header with `struct` over one read-only mmap, parses a field's
value only when asked (`get_field(key).contents()`), skips string arrays by their lengths, and
gives each tensor's bytes as a uint8 view of that one mmap (nothing read until used).

The subset of GGUFReader's interface the loader uses: `get_field(key)` (None or a field with
`contents()`), `tensors` (each with `name`, `shape` fastest dimension first, `tensor_type`, `data`).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# value type -> struct format (scalars); 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True, slots=True)
class Field:
    """One metadata value, parsed on `contents()` (as GGUFReader's: a scalar, a str, or a list)."""

    buf: Any
    type: int
    offset: int  # where the value starts (after its type)

    def contents(self) -> Any:
        return _value(self.buf, self.type, self.offset)[0]


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    shape: np.ndarray  # GGUF order: fastest-varying dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # uint8 view of the file's bytes (read-only)


def _string(buf: Any, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, at)
    return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n


def _skip(buf: Any, vtype: int, at: int) -> int:
    """The offset just past a value of `vtype` at `at`, without building it."""
    if vtype in _SCALARS:
        return at + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
        return at + 8 + struct.unpack_from("<Q", buf, at)[0]
    item, count = struct.unpack_from("<IQ", buf, at)
    at += 12
    if item in _SCALARS:
        return at + count * struct.calcsize(_SCALARS[item])
    for _ in range(count):  # strings (or nested arrays): walk their lengths
        at = _skip(buf, item, at)
    return at


def _value(buf: Any, vtype: int, at: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, at)
    item, count = struct.unpack_from("<IQ", buf, at)
    at += 12
    if item in _SCALARS:
        values = np.frombuffer(buf, dtype=_NUMPY[item], count=count, offset=at)
        return values.tolist(), at + values.nbytes
    out = []
    for _ in range(count):
        value, at = _value(buf, item, at)
        out.append(value)
    return out, at


class GGUFFile:
    """The parsed header of a .gguf file; its tensors' bytes stay in the mmap until read."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # block sizes: the file's own library

        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._mmap)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        at = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key, at = _string(buf, at)
            (vtype,) = struct.unpack_from("<I", buf, at)
            self.fields[key] = Field(buf, vtype, at + 4)
            at = _skip(buf, vtype, at + 4)
        infos = []
        for _ in range(n_tensors):
            name, at = _string(buf, at)
            (n_dims,) = struct.unpack_from("<I", buf, at)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
            ttype, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 12
            infos.append((name, dims, ttype, offset))
        align_field = self.fields.get("general.alignment")
        align = int(align_field.contents()) if align_field is not None else 32
        start = (at + align - 1) // align * align
        whole = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensors: list[Tensor] = []
        for name, dims, ttype, offset in infos:
            kind = GGMLQuantizationType(ttype)
            block, size = GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(dims, dtype=np.int64)) // block * size
            data = whole[start + offset:start + offset + nbytes]
            self.tensors.append(Tensor(name, np.array(dims, dtype=np.uint64), kind, data))

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)
