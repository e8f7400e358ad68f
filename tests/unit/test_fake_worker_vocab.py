"""`python -m worker_svc --fake` reports a vocabulary that covers the gateway tokenizer's ids."""

from __future__ import annotations

import json

from worker_svc.__main__ import build_runner, parse_args
from worker_svc.fake.runner import DEFAULT_FAKE_VOCAB_SIZE, fake_vocab_size


def test_vocab_comes_from_config_then_tokenizer_then_the_default(tmp_path):
    with_config, with_tokenizer, empty = (tmp_path / name for name in ("config", "tokenizer", "empty"))
    for directory in (with_config, with_tokenizer, empty):
        directory.mkdir()
    (with_config / "config.json").write_text(json.dumps({"vocab_size": 3000}))
    (with_tokenizer / "tokenizer.json").write_text(json.dumps({
        "model": {"vocab": {"a": 0, "b": 1, "c": 2}}, "added_tokens": [{"id": 7, "content": "<s>"}]}))
    assert fake_vocab_size(with_config) == 3000
    assert fake_vocab_size(with_tokenizer) == 8
    assert fake_vocab_size(empty) == fake_vocab_size(None) == DEFAULT_FAKE_VOCAB_SIZE == 2048


def test_fake_worker_flag_and_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    assert build_runner(parse_args(["--fake"])).initialize().vocab_size == 2048
    assert build_runner(parse_args(["--fake", "--model", str(tmp_path)])).initialize().vocab_size == 4096
    assert build_runner(parse_args(["--fake", "--vocab-size", "77"])).initialize().vocab_size == 77
