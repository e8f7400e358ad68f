"""Draft-model speculation on the real model runner: greedy outputs token-identical with and
without a draft (fp32), whatever the draft proposes; a draft of another tokenizer is refused.

Drafts: a copy of the tiny generated model with noise on its weights (some drafts accepted, some
rejected: both rollbacks run), the target quantized to int4 at load (`self:q4`), and, on SmolLM2,
its own Q4 self-draft. Pools: roomy, and cramped enough that the batch preempts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from tests.worker.test_spec_decode_llm import mixed_prompts
from worker_svc.draft_model import DraftMismatchError, check_same_tokenizer, resolve_draft

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with 10% noise on its matrices: agrees with the target on some tokens only."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("models") / "noisy-draft"
    shutil.copytree(tiny_model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    noisy = {name: (w + 0.1 * w.std() * torch.randn(w.shape, generator=generator) if w.dim() == 2 else w).contiguous()
             for name, w in weights.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


_baselines: dict[tuple[str, int], list] = {}


def _generate(model: str, num_blocks: int, spec: dict | None, prompts=None, params=GREEDY):
    with LLM(model, dtype="float32", block_size=4, num_gpu_blocks_override=num_blocks,
             max_num_batched_tokens=64, long_prefill_token_threshold=16, speculative_config=spec) as llm:
        results = llm.generate(prompts or mixed_prompts(), params, use_tqdm=False)
        core = llm.scheduler
        assert core.stats().num_used_blocks == 0
        return [r.outputs[0].token_ids for r in results], core


@pytest.mark.parametrize("num_blocks", [256, 40])  # 40 blocks of 4: the batch preempts
@pytest.mark.parametrize("draft", ["noisy", "self:q4"])
def test_greedy_with_a_draft_model_matches_without(tiny_model_dir: str, noisy_draft_dir: str, draft: str,
                                                   num_blocks: int) -> None:
    key = (tiny_model_dir, num_blocks)
    if key not in _baselines:
        _baselines[key] = _generate(tiny_model_dir, num_blocks, None)[0]
    model = noisy_draft_dir if draft == "noisy" else draft
    outputs, core = _generate(tiny_model_dir, num_blocks, {"model": model, "num_speculative_tokens": 4})
    assert outputs == _baselines[key]
    assert core.spec_num_drafts > 0 and 0 < core.spec_num_accepted_tokens < core.spec_num_draft_tokens
    if num_blocks == 40:
        assert core.stats().num_preemptions > 0


def test_sampling_with_a_draft_model_is_seeded_and_reproducible(tiny_model_dir: str, noisy_draft_dir: str) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=7)
    spec = {"model": noisy_draft_dir, "num_speculative_tokens": 3}
    first, core = _generate(tiny_model_dir, 256, spec, params=params)
    again, _ = _generate(tiny_model_dir, 256, spec, params=params)
    assert first == again and core.spec_num_drafts > 0


def test_a_draft_with_another_tokenizer_is_refused(tiny_model_dir: str, tmp_path: Path) -> None:
    with pytest.raises(DraftMismatchError, match="vocabulary of 1000 tokens"):
        check_same_tokenizer("draft", tiny_model_dir, 1000, 2048)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # two ordinary tokens swap ids: same size, other text
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftMismatchError, match="different tokenizers"):
        check_same_tokenizer(str(other), tiny_model_dir, 2048, 2048)
    with pytest.raises(ValueError, match="self:q4"):
        resolve_draft("self:q3", tiny_model_dir)


def test_smollm2_greedy_with_its_q4_self_draft_matches_without(smollm2_dir, chats) -> None:
    prompts = [{"prompt_token_ids": ids} for ids in chats[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(str(smollm2_dir), dtype="float32", max_num_batched_tokens=256) as llm:
        plain = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(smollm2_dir), dtype="float32", max_num_batched_tokens=256,
             speculative_config={"model": "self:q4", "num_speculative_tokens": 4}) as llm:
        drafted = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        core = llm.scheduler
        assert core.spec_num_accepted_tokens > core.spec_num_draft_tokens // 2  # a good draft
    assert drafted == plain


def test_the_worker_takes_the_draft_model_from_the_schedulers_flag() -> None:
    from worker_svc.__main__ import build_config, parse_args, speculative_model

    assert speculative_model('{"model": "self:q4", "num_speculative_tokens": 4}') == "self:q4"
    assert speculative_model('{"method": "ngram", "num_speculative_tokens": 4}') is None
    assert speculative_model(None) is None
    args = parse_args(["--model", "m", "--speculative-config", '{"model": "d.gguf", "num_speculative_tokens": 2}'])
    assert build_config(args).speculative_model == "d.gguf"
