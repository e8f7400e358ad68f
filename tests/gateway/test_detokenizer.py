"""Incremental detokenization over byte-level BPE: never half a UTF-8 character."""

from __future__ import annotations

from gateway.tokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld, 日本語 🙂 and ünïcode done."


def test_multibyte_characters_split_across_tokens_are_held_until_complete(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # the test only means something if some token ends inside a character
    assert any(tokenizer.token_text(t) == "\ufffd" for t in token_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("Prompt:"))
    deltas = [detokenizer.step(t) for t in token_ids]
    assert "" in deltas  # a partial character produced no text yet
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detokenizer.flush() == TEXT


def test_flush_releases_a_truncated_character_as_replacement(tokenizer):
    token_ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(token_ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    assert detokenizer.step(token_ids[0]) == ""
    assert detokenizer.flush() == tokenizer.decode(token_ids[:1])


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.hf.eos_token_id
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [eos]
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skipped.step(t) for t in ids) == "Hi"
    assert "".join(kept.step(t) for t in ids) == "Hi" + tokenizer.hf.eos_token
