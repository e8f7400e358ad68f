"""Synthetic workloads shared by the offline and serving benchmarks (token ids, no download).

- random: prompt and output lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)].
- sharegpt-like: lognormal lengths fitted to ShareGPT's means (prompt ~161, output ~338 tokens)
  with its long tail (sigma ~1: a few prompts/outputs several times the mean).
- prefix-repetition: `num_prefixes` shared prefixes, each followed by a random suffix
  (the case prefix caching is for).
`length_scale` shrinks every length (CPU runs); the mean is scaled, the shape is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "sharegpt-like", "prefix-repetition")
SHAREGPT_MEAN_PROMPT = 161
SHAREGPT_MEAN_OUTPUT = 338
SHAREGPT_SIGMA = 1.0  # lognormal shape: median ~0.6 x mean, p99 ~6 x mean
FIRST_ORDINARY_TOKEN = 10  # below this: special tokens (BOS/EOS/PAD) in the generated vocabularies


@dataclass(frozen=True, slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int  # the benchmark generates exactly this many (ignore_eos)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    dataset: str = "sharegpt-like"
    num_prompts: int = 64
    vocab_size: int = 32000
    max_model_len: int = 2048
    seed: int = 0
    length_scale: float = 1.0
    input_len: int = 128  # random
    output_len: int = 128  # random
    range_ratio: float = 0.5  # random
    num_prefixes: int = 4  # prefix-repetition
    prefix_len: int = 256  # prefix-repetition
    suffix_len: int = 64  # prefix-repetition


def make_workload(spec: WorkloadSpec) -> list[WorkItem]:
    if spec.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {spec.dataset!r}; choose one of {', '.join(DATASETS)}")
    rng = np.random.default_rng(spec.seed)
    if spec.dataset == "random":
        prompt_lens = _uniform_lens(rng, spec.input_len * spec.length_scale, spec)
        output_lens = _uniform_lens(rng, spec.output_len * spec.length_scale, spec)
        items = [WorkItem(_tokens(rng, p, spec), o) for p, o in zip(prompt_lens, output_lens, strict=True)]
    elif spec.dataset == "sharegpt-like":
        prompt_lens = _lognormal_lens(rng, SHAREGPT_MEAN_PROMPT * spec.length_scale, spec.num_prompts)
        output_lens = _lognormal_lens(rng, SHAREGPT_MEAN_OUTPUT * spec.length_scale, spec.num_prompts)
        items = [WorkItem(_tokens(rng, p, spec), o) for p, o in zip(prompt_lens, output_lens, strict=True)]
    else:
        items = _prefix_repetition(rng, spec)
    return [_fit(item, spec.max_model_len) for item in items]


def _uniform_lens(rng: np.random.Generator, mean: float, spec: WorkloadSpec) -> list[int]:
    low = max(1, int(mean * (1 - spec.range_ratio)))
    high = max(low, int(mean * (1 + spec.range_ratio)))
    return rng.integers(low, high + 1, size=spec.num_prompts).tolist()


def _lognormal_lens(rng: np.random.Generator, mean: float, count: int) -> list[int]:
    # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2): choose mu so the mean is `mean`.
    mu = math.log(max(mean, 1.0)) - SHAREGPT_SIGMA**2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, SHAREGPT_SIGMA, size=count))).astype(int).tolist()


def _tokens(rng: np.random.Generator, length: int, spec: WorkloadSpec) -> list[int]:
    return rng.integers(FIRST_ORDINARY_TOKEN, spec.vocab_size, size=int(length)).tolist()


def _prefix_repetition(rng: np.random.Generator, spec: WorkloadSpec) -> list[WorkItem]:
    prefix_len = max(1, int(spec.prefix_len * spec.length_scale))
    suffix_len = max(1, int(spec.suffix_len * spec.length_scale))
    output_len = max(1, int(spec.output_len * spec.length_scale))
    prefixes = [_tokens(rng, prefix_len, spec) for _ in range(spec.num_prefixes)]
    return [WorkItem(prefixes[i % spec.num_prefixes] + _tokens(rng, suffix_len, spec), output_len)
            for i in range(spec.num_prompts)]


def _fit(item: WorkItem, max_model_len: int) -> WorkItem:
    """Cut the prompt, then the output, so prompt + output fits max_model_len (the long tail)."""
    prompt = item.prompt_token_ids[: max(1, max_model_len // 2)]
    return WorkItem(prompt, max(1, min(item.max_tokens, max_model_len - len(prompt))))
