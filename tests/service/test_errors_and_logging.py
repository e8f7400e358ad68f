"""The error table, the JSON log format with bound context, and the scheduler's import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import structlog

from pagoda.contract.error_table import grpc_status_for, http_status_for, http_status_for_grpc
from pagoda.contract.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    PlanError,
    QueueFullError,
    WorkerUnavailableError,
)
from pagoda.runtime.logging import bound_contextvars, configure_logging, get_logger


@pytest.mark.parametrize("error, code, http", [
    (InvalidRequestError("too long"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (QueueFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (DuplicateRequestError("dup"), grpc.StatusCode.ALREADY_EXISTS, 409),
    (WorkerUnavailableError("gone"), grpc.StatusCode.UNAVAILABLE, 503),
    (PlanError("bad"), grpc.StatusCode.FAILED_PRECONDITION, 400),
])
def test_domain_errors_map_to_one_status_each(error, code, http):
    assert grpc_status_for(error) == (code, str(error))
    assert http_status_for(error) == http == http_status_for_grpc(code)


def test_subclasses_inherit_and_unknown_errors_hide_their_message():
    class ContextTooLong(InvalidRequestError):
        pass

    assert grpc_status_for(ContextTooLong("x"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_status_for(KeyError("secret internals")) == (grpc.StatusCode.INTERNAL, "internal error")
    assert http_status_for(KeyError("x")) == 500


def test_json_logs_carry_bound_request_and_step_ids(capsys):
    configure_logging(json=True, service="test")
    try:
        with bound_contextvars(request_id="r-1", step_id=7):
            get_logger("t").info("request_added", num_prompt_tokens=3)
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    finally:
        structlog.reset_defaults()  # the captured stdout closes after this test
    assert {k: line[k] for k in ("event", "request_id", "step_id", "num_prompt_tokens", "service", "level")} == {
        "event": "request_added", "request_id": "r-1", "step_id": 7, "num_prompt_tokens": 3, "service": "test",
        "level": "info"}


def test_the_scheduler_process_never_imports_torch():
    code = ("import sys, scheduler_svc.__main__, scheduler_svc.server; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
