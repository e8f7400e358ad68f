"""The scheduler core's one frozen config (built from flags in `__main__`, or by the offline LLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int  # from the worker's Init answer
    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # A prefill longer than this gets at most this many tokens per step, so one long prompt cannot
    # monopolise a step. 0 = auto (max_num_batched_tokens // 2).
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 4096  # the bounded queue: beyond it add_request raises QueueFullError
    max_waiting_tokens: int | None = None  # optional bound on the prompt tokens waiting
    eos_token_ids: tuple[int, ...] = ()
    policy: Literal["fcfs", "priority"] = "fcfs"
    max_inflight_steps: int = 2  # 2 = the next plan goes out before the last result is back
    # A request that took part in this many failed steps is failed (poison.py); one that fails a
    # step alone, after failing one batched, is failed at once.
    max_step_failures: int = 3
