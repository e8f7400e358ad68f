"""The offline beam-search API, shaped like vLLM's `LLM.beam_search(prompts, BeamSearchParams)`.

vLLM runs beam search as a loop in front of its engine (one request per beam per step). Here the
engine does it itself on copy-on-write forks (scheduler_svc/core/beam_group.py): a prompt is
prefilled once, beams share their common blocks, and nothing is recomputed. The ranking is HF
transformers' (`num_beams=W, do_sample=False, early_stopping=True`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.params import SamplingParams


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # vLLM's field; only 0 (rank by the model's own logprobs) is supported
    length_penalty: float = 1.0  # score = cum_logprob / (output length ** length_penalty)

    def to_sampling_params(self) -> SamplingParams:
        if self.temperature != 0.0:
            raise InvalidRequestError("beam search ranks by the model's logprobs: temperature must be 0")
        return SamplingParams(n=self.beam_width, temperature=0.0, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, beam_width=self.beam_width,
                              length_penalty=self.length_penalty)


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam: prompt + output tokens (the stop token included, as HF returns them)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None  # the output's text
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # vLLM's field; per-token logprobs are not kept


@dataclass(slots=True)
class BeamSearchOutput:
    """The beams of one prompt, best (highest length-penalised score) first."""

    sequences: list[BeamSearchSequence]
