"""Rank 0 hears from every other rank: a counter per rank in the rendezvous store.

Why: a follower whose process dies closes its sockets and rank 0's next collective raises at once,
but a follower whose node is lost (powered off, partitioned, frozen) closes nothing: rank 0 would
wait inside its next receive until DATA_TIMEOUT (minutes), holding every request. The other
direction is covered by rank 0's pings and the follower's Watchdog (tp_rank.py).

How: each follower bumps `pagoda/alive/<rank>` in torch.distributed's TCPStore (the one the
`tcp://` rendezvous already runs on rank 0) every HEARTBEAT_S from a thread of its own, so a rank
busy in a long forward still beats (torch ops release the GIL). Rank 0 reads the counters on its
heartbeat thread; one that has not moved for FOLLOWER_SILENCE_S fails the group (tp_worker._fail),
which kills the ranks it can reach and exits so the launcher restarts the instance.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from pagoda.runtime.logging import get_logger

if TYPE_CHECKING:
    import torch.distributed as dist

log = get_logger(__name__)

HEARTBEAT_S = 2.0  # rank 0 pings idle ranks, and every rank bumps its counter, this often
FOLLOWER_SILENCE_S = 20.0  # a rank whose counter stood still this long is gone
STORE_TIMEOUT = timedelta(seconds=10)  # one store call never blocks a beat longer


def _key(rank: int) -> str:
    return f"pagoda/alive/{rank}"


def store_client(init_method: str) -> dist.TCPStore | None:
    """A client of the rendezvous store of a `tcp://HOST:PORT` init method (None for another
    scheme: then nobody beats and nobody listens)."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        log.warning("rank_liveness_off", init_method=init_method, reason="not a tcp:// rendezvous")
        return None
    import torch.distributed as dist  # here: tp_rank reads HEARTBEAT_S before it imports torch

    return dist.TCPStore(url.hostname, url.port, is_master=False, timeout=STORE_TIMEOUT,
                         wait_for_workers=False)


def start_beating(store: dist.TCPStore | None, rank: int) -> None:
    """A follower's side: bump this rank's counter every HEARTBEAT_S until the process ends. A
    store that stops answering means rank 0 is gone: the beats stop, the Watchdog ends the rank."""
    if store is None:
        return

    def beat() -> None:
        while True:
            try:
                store.add(_key(rank), 1)
            except Exception as error:  # noqa: BLE001 - rank 0's store is gone: stop beating
                log.warning("rank_heartbeat_stopped", rank=rank, error=repr(error))
                return
            time.sleep(HEARTBEAT_S)  # the beat's period

    threading.Thread(target=beat, daemon=True, name=f"rank{rank}-beat").start()


class Listener:
    """Rank 0's side: which followers' counters have stood still for FOLLOWER_SILENCE_S."""

    def __init__(self, store: dist.TCPStore | None, ranks: Iterable[int],
                 clock: Callable[[], float] = time.monotonic,
                 silence_s: float = FOLLOWER_SILENCE_S) -> None:
        self._store = store
        self._clock = clock
        self._silence_s = silence_s
        now = clock()
        self._seen = {rank: (0, now) for rank in ranks}  # rank -> (last count, when it last moved)

    def silent(self) -> dict[int, float]:
        """Rank -> seconds since its counter last moved, for the ranks silent past the bound."""
        if self._store is None:
            return {}
        now, silent = self._clock(), {}
        for rank, (count, since) in self._seen.items():
            current = self._store.add(_key(rank), 0)  # read (and create) without moving it
            if current != count:
                self._seen[rank] = (current, now)
            elif now - since > self._silence_s:
                silent[rank] = now - since
        return silent
