"""Structured logging for every Pagoda process: one structlog set-up, JSON when not on a TTY.

Conventions (DESIGN.md): one snake_case, past-tense event name per thing that happened
(`request_added`, `worker_lost`), key=value fields, never one line per token. `request_id` and
`step_id` are bound with `bind_contextvars` / `bound_contextvars` and merged into every line.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.contextvars import bind_contextvars, bound_contextvars, clear_contextvars

__all__ = ["configure_logging", "get_logger", "bind_contextvars", "bound_contextvars",
           "clear_contextvars"]


def configure_logging(json: bool | None = None, level: str = "info", service: str | None = None) -> None:
    """Configure structlog once per process. `json=None`: JSON unless stdout is a terminal."""
    if json is None:
        json = not sys.stdout.isatty()
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty()))
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if service:
        processors.insert(0, _add_service(service))
    processors += [structlog.processors.format_exc_info, renderer] if json else [renderer]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )


def _add_service(service: str):
    def add(_logger, _method, event_dict):
        event_dict.setdefault("service", service)
        return event_dict
    return add


def get_logger(name: str):
    return structlog.get_logger(name)
