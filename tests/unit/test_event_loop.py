"""The services' loop choice (pagoda/runtime/event_loop.py): uvloop when importable, unless turned off."""

from __future__ import annotations

import asyncio
import sys
import types

from pagoda.runtime import event_loop


def _fake_uvloop(monkeypatch) -> types.ModuleType:
    module = types.ModuleType("uvloop")
    module.new_event_loop = asyncio.new_event_loop  # stands in for uvloop's factory
    monkeypatch.setitem(sys.modules, "uvloop", module)
    return module


def test_uvloop_is_used_where_it_is_installed(monkeypatch):
    monkeypatch.delenv(event_loop.ENV, raising=False)
    module = _fake_uvloop(monkeypatch)
    assert event_loop.loop_factory() is module.new_event_loop


def test_the_standard_loop_without_uvloop_or_when_asked(monkeypatch):
    _fake_uvloop(monkeypatch)
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.loop_factory() is None
    monkeypatch.delenv(event_loop.ENV)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert event_loop.loop_factory() is None


def test_run_returns_what_the_coroutine_returns(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert event_loop.run(answer()) == 42
