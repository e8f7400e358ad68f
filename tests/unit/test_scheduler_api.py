"""The Scheduler's shape (issue 30): one class, no mixins, its whole public API declared in
scheduler.py; its features are objects it holds. (No import circle and no crowded folder anywhere:
tests/unit/test_house.py.)"""

from __future__ import annotations

import inspect

from scheduler_svc.core import scheduler as scheduler_module
from scheduler_svc.core.scheduler import Scheduler


def test_the_scheduler_is_one_class_without_mixins():
    assert Scheduler.__mro__ == (Scheduler, object)


def test_every_public_method_and_property_is_declared_in_scheduler_py():
    public = [name for name in dir(Scheduler) if not name.startswith("_")]
    assert {"schedule", "update", "add_request", "abort", "stats", "check_invariants"} <= set(public)
    for name in public:
        assert name in Scheduler.__dict__, f"Scheduler.{name} is inherited, not declared"
        member = Scheduler.__dict__[name]
        func = member.fget if isinstance(member, property) else member
        assert inspect.getsourcefile(func) == inspect.getsourcefile(scheduler_module), name
        assert func.__qualname__ == f"Scheduler.{name}", name
