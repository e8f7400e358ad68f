"""The gateway's view of `common.proto`: the shared codec, plus finish reasons as OpenAI strings.

Sampling params travel through `pagoda.contract.common_codec` (validation lives in the core dataclass).
"""

from __future__ import annotations

from pagoda.contract.common_codec import (
    finish_reason_from_pb,
    finish_reason_to_pb,
    sampling_from_pb,
    sampling_to_pb,
)

__all__ = ["finish_reason_name", "finish_reason_to_pb", "sampling_from_pb", "sampling_to_pb"]


def finish_reason_name(code: int) -> str | None:
    """"stop" / "length" / "abort" / "error", or None while the sequence runs."""
    reason = finish_reason_from_pb(code)
    return reason.value if reason is not None else None
