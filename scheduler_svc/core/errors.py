"""Errors the scheduler core raises on purpose (InvalidRequestError lives in params.py)."""

from __future__ import annotations

from scheduler_svc.core.params import InvalidRequestError


class SchedulerError(Exception):
    """Base of the scheduler core's own errors."""


class QueueFullError(SchedulerError):
    """The bounded waiting queue is full; maps to RESOURCE_EXHAUSTED / HTTP 429. Retry later."""


__all__ = ["InvalidRequestError", "QueueFullError", "SchedulerError"]
