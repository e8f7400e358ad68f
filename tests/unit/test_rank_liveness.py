"""Rank 0's view of its followers' heartbeat counters (worker_svc/parallel/liveness.py), on a real
torch.distributed TCPStore and a hand-moved clock."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.e2e.conftest import free_port
from worker_svc.parallel.liveness import FOLLOWER_SILENCE_S, Listener, store_client


@pytest.fixture
def init_method():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    yield f"tcp://127.0.0.1:{port}"
    del master


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_follower_whose_counter_stands_still_is_reported_with_its_silence(init_method) -> None:
    clock = Clock()
    follower1, follower2 = store_client(init_method), store_client(init_method)
    listener = Listener(store_client(init_method), [1, 2], clock=clock)
    for _ in range(3):  # both beat while the clock moves past the bound: nobody is silent
        follower1.add("pagoda/alive/1", 1)
        follower2.add("pagoda/alive/2", 1)
        clock.now += FOLLOWER_SILENCE_S * 0.6
        assert listener.silent() == {}
    follower2.add("pagoda/alive/2", 1)  # rank 1 froze; rank 2 goes on
    clock.now += FOLLOWER_SILENCE_S * 0.6
    assert listener.silent() == {}  # rank 1's counter last moved 0.6 bounds ago
    follower2.add("pagoda/alive/2", 1)
    clock.now += FOLLOWER_SILENCE_S * 0.6
    assert listener.silent() == pytest.approx({1: FOLLOWER_SILENCE_S * 1.2})


def test_a_follower_that_never_beat_is_silent_from_the_listeners_start(init_method) -> None:
    clock = Clock()
    listener = Listener(store_client(init_method), [1], clock=clock)
    clock.now += FOLLOWER_SILENCE_S + 1
    assert listener.silent() == {1: FOLLOWER_SILENCE_S + 1}


def test_a_rendezvous_without_a_store_turns_liveness_off() -> None:
    assert store_client("env://") is None
    assert Listener(None, [1, 2, 3]).silent() == {}
