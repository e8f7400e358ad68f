"""A test-only fault hook: a step that computes a listed request raises, as a model that crashes on
that request would (the poison-isolation tests: tests/service/test_poison_isolation.py).

Set PAGODA_TEST_FAIL_REQUEST_IDS=id[,id...] in a worker's environment, or assign
`fail_request_ids` in-process. Never set in production: the worker logs a warning at start when it
is. A forked child (`id#i`) counts as its request.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

ENV_VAR = "PAGODA_TEST_FAIL_REQUEST_IDS"
fail_request_ids: frozenset[str] = frozenset(i for i in os.environ.get(ENV_VAR, "").split(",") if i)


class InjectedFault(RuntimeError):
    """Raised by `check` for a listed request."""


def check(request_ids: Iterable[str]) -> None:
    """Raise InjectedFault when one of the step's computed `request_ids` is listed."""
    if not fail_request_ids:
        return
    for request_id in request_ids:
        base = request_id.split("#", 1)[0]
        if base in fail_request_ids:
            raise InjectedFault(f"injected fault: the model fails on request {base}")
