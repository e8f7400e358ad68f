"""Structured outputs on the worker: the matcher's lazy catch-up (replay, rollback of drafts), the
bitmask in the sampler for the rows that ask, and `LLM` end to end on the tiny random model, whose
free text is noise, so every match below is the grammar's doing (n > 1, speculation included)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.contract.structured import StructuredOutputsParams
from worker_svc.sampler import Sampler, SamplingRow
from worker_svc.structured_output import GrammarCompiler, apply_grammar_masks

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "level": {"enum": ["low", "mid", "high"]}},
          "required": ["ok", "level"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str):
    with LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def compiler(llm: LLM) -> GrammarCompiler:
    info = llm.worker_info
    return GrammarCompiler(llm.model_dir, info.vocab_size, info.eos_token_ids)


def _text(llm: LLM, ids: list[int]) -> str:
    return llm.tokenizer.decode(ids, skip_special_tokens=True)


def test_matcher_replays_outputs_and_rolls_back_what_the_list_lost(llm: LLM, compiler) -> None:
    choice = StructuredOutputsParams(choice=["alpha beta", "gamma"])
    ids = llm.tokenizer("alpha beta", add_special_tokens=False)["input_ids"]
    state = compiler.state(choice)
    prompt = [1, 2, 3]
    matcher = state.matcher(prompt + ids[:1], 3)
    assert not matcher.is_error()
    wrong = llm.tokenizer("gamma", add_special_tokens=False)["input_ids"]
    matcher = state.matcher(prompt + ids[:1] + wrong, 3)  # a refused draft: catch-up stops before it
    assert not matcher.is_error()
    matcher = state.matcher(prompt + ids, 3)  # the list now holds the real continuation
    assert matcher.is_accepting() and not matcher.is_error()
    fresh = state.fork().matcher(prompt + ids, 3)  # a fork replays from the start
    assert fresh.is_accepting()


def test_sampler_masks_only_rows_with_a_grammar(llm: LLM, compiler) -> None:
    info = llm.worker_info
    sampler = Sampler(info.eos_token_ids, torch.device("cpu"))
    regex = compiler.state(StructuredOutputsParams(regex="[0-9]+"))
    greedy = SamplingParams(temperature=0.0)
    logits = torch.randn(2, info.vocab_size, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(greedy, [5, 6], 2, grammar=regex), SamplingRow(greedy, [5, 6], 2)]
    tokens = sampler(logits.clone(), rows).token_ids
    assert re.fullmatch("[0-9]+", _text(llm, [tokens[0]]).strip() or "x")
    assert tokens[1] == int(logits[1].argmax())


def _generate(llm: LLM, structured: StructuredOutputsParams, n: int = 1, temperature: float = 0.0,
              max_tokens: int = 64) -> list[str]:
    params = SamplingParams(n=n, temperature=temperature, seed=1, max_tokens=max_tokens,
                            structured_outputs=structured)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0]
    return [c.text for c in out.outputs]


def test_llm_json_schema_choice_and_regex_on_noise(llm: LLM) -> None:
    for text in _generate(llm, StructuredOutputsParams(json=SCHEMA), n=3, temperature=1.0):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in _generate(llm, StructuredOutputsParams(choice=["red", "green", "blue"]), n=4,
                          temperature=1.0):
        assert text in {"red", "green", "blue"}
    for text in _generate(llm, StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{2}"), n=2, temperature=1.0):
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", text), text
    json.loads(_generate(llm, StructuredOutputsParams(json_object=True), max_tokens=200)[0])
    assert _generate(llm, StructuredOutputsParams(grammar='root ::= "yes" | "no"'))[0] in {"yes", "no"}


def test_speculative_drafts_the_grammar_refuses_are_rejected(tiny_model_dir: str) -> None:
    """n-gram drafts come from the prompt, which does not match the grammar: each must be refused."""
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1}
    with LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=256,
             speculative_config=speculative) as engine:
        prompt = engine.tokenizer('{"ok": true, "level": "low"} {"ok": true, "level": "low"}',
                                  add_special_tokens=False)["input_ids"]
        params = SamplingParams(temperature=0.0, max_tokens=64,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
        out = engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_lazy_greedy_masking_picks_what_full_masking_picks(llm: LLM, compiler) -> None:
    """Greedy rows are masked only when their argmax is refused: the token must be the same."""
    info = llm.worker_info
    sampler = Sampler(info.eos_token_ids, torch.device("cpu"))
    schema = compiler.state(StructuredOutputsParams(json=SCHEMA))
    text = llm.tokenizer('{"ok": true, "level": "', add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(temperature=0.0)
    for seed in range(8):
        logits = torch.randn(3, info.vocab_size, generator=torch.Generator().manual_seed(seed))
        favoured = llm.tokenizer("low", add_special_tokens=False)["input_ids"][0]
        if seed % 2:
            logits[:, favoured] = 50.0  # an allowed argmax: no mask needed
        rows = [SamplingRow(greedy, [5] + text, 1, grammar=schema), SamplingRow(greedy, [5], 1, grammar=schema),
                SamplingRow(greedy, [5], 1)]
        expected = logits.clone()
        apply_grammar_masks(expected, rows, info.eos_token_ids)
        assert sampler(logits.clone(), rows).token_ids == expected.argmax(dim=-1).tolist()


def test_llm_refuses_a_bad_spec_before_generating(llm: LLM) -> None:
    from pagoda.contract.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="invalid regex"):
        _generate(llm, StructuredOutputsParams(regex="(("))
    assert not llm.scheduler.has_unfinished_requests()


def test_min_tokens_with_a_grammar_is_refused() -> None:
    from pagoda.contract.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(choice=["a"]))
