"""worker_svc/model_loader/gguf_file.py: the fast GGUF header reader gives what gguf.GGUFReader gives
(every field's contents, every tensor's name, shape, type and bytes) on a file with every value type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.worker.gguf_files import gguf_blocks
from worker_svc.model_loader.gguf_file import GGUFFile


def _write(path, alignment: int | None = None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_uint64("test.u64", 2**40 + 3)
    w.add_int8("test.i8", -5)
    w.add_float32("test.f32", 0.1)
    w.add_float64("test.f64", 1e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo ☃")
    w.add_array("test.strings", ["a", "", "ünïcode", "x" * 300])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    for name, qtype in (("q8", "Q8_0"), ("q4k", "Q4_K"), ("q6k", "Q6_K")):
        raw = gguf_blocks(qtype, 2, 256, 1)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_same_fields_and_tensors_as_gguf_reader(tmp_path, alignment):
    path = _write(tmp_path / "t.gguf", alignment)
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert set(ours.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}  # its pseudo-fields
    for key in ours.fields.keys() - {"test.nested"}:  # GGUFReader flattens an array of arrays; we keep it
        assert ours.get_field(key).contents() == ref.get_field(key).contents(), key
    assert ours.get_field("test.nested").contents() == [[1, 2], [3]]
    assert ours.get_field("test.strings").contents() == ["a", "", "ünïcode", "x" * 300]
    assert ours.get_field("absent") is None
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.shape.tolist() == b.shape.tolist() and a.tensor_type == b.tensor_type, a.name
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1)), a.name


def test_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)
