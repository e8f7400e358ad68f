"""What the scheduler core hands back to its callers after each step: per-sequence deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason
from pagoda.contract.step import TokenLogprobs


@dataclass(slots=True)
class SequenceDelta:
    """New tokens of one sequence of one request since the last delta; final when finish_reason."""

    request_id: RequestId  # the caller's id (the same for all n sequences)
    seq_index: int  # 0..n-1
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # empty unless asked for
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # with FinishReason.ERROR: why this request alone failed (poison.py)
    cumulative_logprob: float | None = None  # beam search: the finished beam's summed logprobs
    # With prompt_logprobs: the logprobs of prompt tokens 1.. (the first has none), once per
    # request, on sequence 0's delta that carries its first token.
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
