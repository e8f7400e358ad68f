"""logit_bias, allowed_token_ids and bad_words: through the sampler (batched rows, untouched batch
mates), the contract's validation and codec, and the real runner through `LLM`."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM
from pagoda.contract.common_codec import sampling_from_pb, sampling_to_pb
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.params import SamplingParams, check_vocab
from tests.worker.test_sampler import VOCAB, make_sampler, random_logits, row

GREEDY = SamplingParams(temperature=0.0)


def test_bias_removes_and_forces_tokens_only_in_its_row() -> None:
    logits = random_logits(3, seed=1)
    best = logits.argmax(dim=-1).tolist()
    rows = [row(SamplingParams(temperature=0.0, logit_bias={best[0]: -100})),
            row(GREEDY),
            row(SamplingParams(temperature=0.0, logit_bias={17: 100, 18: -5}))]
    out = make_sampler()(logits.clone(), rows).token_ids
    assert out[0] != best[0] and out[1] == best[1] and out[2] == 17
    second = logits[0].clone()
    second[best[0]] = -1e9
    assert out[0] == int(second.argmax())


def test_allowed_token_ids_restrict_sampled_rows_too() -> None:
    allowed = (4, 9, 33)
    rows = [row(SamplingParams(temperature=1.0, seed=s, allowed_token_ids=allowed)) for s in range(20)]
    rows.append(row(GREEDY))
    logits = random_logits(len(rows), seed=2)
    out = make_sampler()(logits.clone(), rows).token_ids
    assert all(t in allowed for t in out[:-1])
    assert out[-1] == int(logits[-1].argmax())


def test_bad_words_ban_single_tokens_and_the_last_token_after_a_matching_prefix() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 20] = 5.0
    logits[:, 21] = 4.0
    words = ((20,),)
    two_token = ((40, 20),)  # banned only right after 40
    rows = [row(SamplingParams(temperature=0.0, bad_words_token_ids=words)),
            row(SamplingParams(temperature=0.0, bad_words_token_ids=two_token), outputs=[40]),
            row(SamplingParams(temperature=0.0, bad_words_token_ids=two_token), outputs=[41])]
    assert make_sampler()(logits.clone(), rows).token_ids == [21, 21, 20]


def test_validation_and_codec_round_trip() -> None:
    for bad in ({1: 101}, {1: float("nan")}, {-1: 3}, {"x": 1}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(logit_bias=bad)
    with pytest.raises(InvalidRequestError):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(InvalidRequestError, match="logit_bias: token id 64"):
        check_vocab(SamplingParams(logit_bias={64: 1}), VOCAB)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        check_vocab(SamplingParams(allowed_token_ids=[1, 99]), VOCAB)
    params = SamplingParams(logit_bias={"5": 2.5, 7: -100}, allowed_token_ids=[1, 2],
                            bad_words_token_ids=[[3], [4, 5]])
    assert params.logit_bias == {5: 2.5, 7: -100.0}
    back = sampling_from_pb(sampling_to_pb(params))
    assert (back.logit_bias, back.allowed_token_ids, back.bad_words_token_ids) == (
        {5: 2.5, 7: -100.0}, (1, 2), ((3,), (4, 5)))
    assert sampling_from_pb(sampling_to_pb(SamplingParams())).logit_bias is None


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str):
    with LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=256) as engine:
        yield engine


def test_through_the_runner_with_a_batch_mate(llm: LLM) -> None:
    rng = random.Random(0)
    vocab = llm.worker_info.vocab_size
    mine, mate = ([rng.randrange(10, vocab) for _ in range(12)], [rng.randrange(10, vocab) for _ in range(9)])

    def run(params: list[SamplingParams], prompts=(mine, mate)) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain, mate_alone = run([greedy, greedy])
    first = plain[0]
    removed, mate_out = run([SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                            logit_bias={first: -100}), greedy])
    assert removed[0] != first and first not in removed and mate_out == mate_alone
    forced = run([SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={11: 100}),
                  greedy])[0]
    assert forced == [11] * 6
    allowed = run([SamplingParams(temperature=0.9, seed=1, max_tokens=6, ignore_eos=True,
                                  allowed_token_ids=[12, 13]), greedy])[0]
    assert set(allowed) <= {12, 13}
    banned = run([SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                 bad_words_token_ids=[[t] for t in set(plain)]), greedy])[0]
    assert not set(banned) & set(plain)
