"""The services' asyncio loop: uvloop where it is installed, the standard loop otherwise.

At one request at a time every token crosses three event loops (worker, scheduler, gateway), each
woken several times per token by gRPC and HTTP I/O. On a small CPU machine that loop overhead is
taken from the cores the model's forward runs on, so it shows up in the time per output token.
uvloop (libuv, as vLLM's API server and uvicorn use it) runs the same asyncio programs with less
CPU per wake-up; grpc.aio supports it. `PAGODA_EVENT_LOOP=asyncio` forces the standard loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")
ENV = "PAGODA_EVENT_LOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None (asyncio's default) when it is absent or turned off."""
    if os.environ.get(ENV, "auto") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_factory` picks; says which in the log."""
    factory = loop_factory()
    log.info("event_loop", loop="uvloop" if factory is not None else "asyncio")
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
