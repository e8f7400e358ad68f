"""The batched sampler against plain per-row reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.contract.params import SamplingParams
from worker_svc.sampler import SERIAL_ARGMAX_ROWS, Sampler, SamplingRow, row_argmax

VOCAB = 64
EOS = 3
CPU = torch.device("cpu")


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(eos_token_ids=(EOS,), device=CPU, seed=seed)


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(params: SamplingParams, outputs: list[int] = (), prompt: list[int] = (5, 6, 7),
        seq_index: int = 0) -> SamplingRow:
    tokens = list(prompt) + list(outputs)
    return SamplingRow(params, tokens, len(prompt), seq_index)


# -- plain per-row references --------------------------------------------------------------------

def reference_adjust(logits: list[float], r: SamplingRow) -> list[float]:
    out = list(logits)
    p = r.params
    outputs = list(r.token_ids[r.num_prompt_tokens:])
    if len(outputs) < p.min_tokens:
        for t in set(p.stop_token_ids) | ({EOS} if not p.ignore_eos else set()):
            out[t] = -math.inf
    for t in set(r.token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(outputs):
        out[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    return out


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    if p.min_p > 0:
        cut = p.min_p * max(probs)
        probs = [q if q >= cut else 0.0 for q in probs]
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    if p.top_k > 0:
        for t in order[p.top_k:]:
            probs[t] = 0.0
    total = sum(probs)
    kept, mass = set(), 0.0
    for t in order:
        if probs[t] == 0.0 or mass >= p.top_p:
            break
        kept.add(t)
        mass += probs[t] / total
    probs = [q if t in kept else 0.0 for t, q in enumerate(probs)]
    return [q / sum(probs) for q in probs]


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
])
def test_sampling_probs_match_reference(params: SamplingParams) -> None:
    logits = random_logits(4, seed=1)
    got = make_sampler().sampling_probs(logits.clone(), [row(params)] * 4)
    for i in range(4):
        expected = torch.tensor(reference_probs(logits[i].tolist(), params))
        torch.testing.assert_close(got[i], expected, atol=1e-6, rtol=1e-5)


def test_penalties_and_min_tokens_match_reference() -> None:
    rows = [
        row(SamplingParams(repetition_penalty=1.5), outputs=[9, 9, 10]),
        row(SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), outputs=[9, 9, 10, 5]),
        row(SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.2),
            outputs=[11, 12, 11]),
        row(SamplingParams(min_tokens=3, stop_token_ids=(20, 21)), outputs=[1]),
        row(SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=(20,)), outputs=[]),
        row(SamplingParams(min_tokens=1), outputs=[4]),  # reached min_tokens: nothing masked
    ]
    logits = random_logits(len(rows), seed=2)
    got = make_sampler().adjust_logits(logits.clone(), rows)
    for i, r in enumerate(rows):
        expected = torch.tensor(reference_adjust(logits[i].tolist(), r))
        torch.testing.assert_close(got[i], expected)


def test_min_tokens_blocks_eos_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 8] = 5.0
    params = SamplingParams(temperature=0.0, min_tokens=2)
    out = make_sampler()(logits.clone(), [row(params, outputs=[1]), row(params, outputs=[1, 2])])
    assert out.token_ids == [8, EOS]


def test_greedy_takes_argmax_after_penalties() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 30] = 2.0
    logits[0, 31] = 1.5
    penalised = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert make_sampler()(logits.clone(), [row(penalised, outputs=[30])]).token_ids == [31]
    assert make_sampler()(logits.clone(), [row(SamplingParams(temperature=0.0))]).token_ids == [30]


def seeded_sequence(sampler: Sampler, params: SamplingParams, batch_mates: list[SamplingRow],
                    steps: int, seq_index: int = 0) -> list[int]:
    """Sample `steps` tokens for one seeded row, each step in a batch with `batch_mates`."""
    outputs: list[int] = []
    for step in range(steps):
        target = row(params, outputs=outputs, seq_index=seq_index)
        at = step % (len(batch_mates) + 1)  # the target moves around the batch
        rows = batch_mates[:at] + [target] + batch_mates[at:]
        logits = random_logits(len(rows), seed=100 + step)
        logits[at] = random_logits(1, seed=7 + step)[0]  # the target's logits: fixed per step
        outputs.append(sampler(logits, rows).token_ids[at])
    return outputs


def test_seeded_row_is_independent_of_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)
    alone = seeded_sequence(make_sampler(seed=0), params, [], steps=12)
    mates = [row(SamplingParams(temperature=1.0)), row(SamplingParams(temperature=0.0)),
             row(SamplingParams(temperature=0.5, seed=99, presence_penalty=1.0), outputs=[2, 3]),
             row(SamplingParams(temperature=1.2, top_k=3))]
    mixed = seeded_sequence(make_sampler(seed=5), params, mates, steps=12)
    assert mixed == alone
    other_fork = seeded_sequence(make_sampler(seed=0), params, [], steps=12, seq_index=1)
    assert other_fork != alone  # a fork's own randomness


def test_exponential_race_draws_from_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((4000, VOCAB), -math.inf)
    logits[:, :4] = probs.log()
    tokens = make_sampler(seed=3)(logits, [row(SamplingParams(temperature=1.0))] * 4000).token_ids
    frequencies = torch.bincount(torch.tensor(tokens), minlength=4)[:4].float() / 4000
    torch.testing.assert_close(frequencies, probs, atol=0.03, rtol=0)


def test_sampled_tokens_stay_in_the_top_k_support() -> None:
    logits = random_logits(1, seed=4).repeat(200, 1)
    params = SamplingParams(temperature=2.0, top_k=4)
    tokens = set(make_sampler(seed=1)(logits.clone(), [row(params)] * 200).token_ids)
    assert tokens <= set(logits[0].topk(4).indices.tolist())
    assert len(tokens) > 1


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(3, seed=5)
    rows = [row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.7), outputs=[1]),
            row(SamplingParams(temperature=1.0, logprobs=0)),
            row(SamplingParams(temperature=1.0))]
    out = make_sampler()(logits.clone(), rows)
    expected = torch.log_softmax(logits, dim=-1)
    for i in range(2):
        assert out.logprobs[i].logprob == pytest.approx(expected[i, out.token_ids[i]].item(), abs=1e-6)
    values, ids = expected[0].topk(3)
    assert [t for t, _ in out.logprobs[0].top] == ids.tolist()
    assert [v for _, v in out.logprobs[0].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[1].top == []
    assert out.logprobs[2] is None


@pytest.mark.parametrize("rows", [1, SERIAL_ARGMAX_ROWS, SERIAL_ARGMAX_ROWS + 1])
def test_row_argmax_is_torch_argmax_ties_and_nan_included(rows: int) -> None:
    """The serial (numpy) argmax of few rows and torch's of many give the same ids: the first of
    tied maxima, and a NaN's index where a row has one (both count NaN as the maximum)."""
    logits = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows))
    logits[0, 17] = logits[0, 40000] = 1e4  # a tie: the first wins
    if rows > 1:
        logits[1, 123] = float("nan")
        logits[1, 9] = 1e4
    with torch.inference_mode():
        got = row_argmax(logits)
    assert got.dtype == torch.int64 and got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[0] == 17 and (rows == 1 or got[1] == 123)
