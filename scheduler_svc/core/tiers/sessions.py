"""Session leases: a conversation's prefix blocks stay pinned between its turns, until a TTL expires.

A request may carry a `session_id` and a retain TTL (seconds). When it finishes, the full blocks
of its history that are registered in the prefix index (prompt and computed output) take one more
reference, held by the session's lease, and the lease's previous blocks (the last turn's, a prefix
of these) drop theirs. A block with a reference is never on the evictable LRU, so the session's
next turn, whenever it comes within the TTL, hits its whole history. The lease expires TTL seconds
after the turn finished (checked at each schedule()), or ends by `end(session_id)`
(`DELETE /v1/sessions/{id}`); its blocks then become ordinary cached blocks, evicted by LRU.

Under pressure (admission or a running sequence cannot get its blocks) leases are demoted before
any running sequence is preempted, least recently used first: their blocks drop the lease's
reference and go to the evictable LRU, from which eviction copies them to the host tier
(host_tier.py, with --kv-offloading-size) instead of dropping them. The demoted lease lives on
(its TTL unchanged) and pins the session's next turn again.

A session is scoped by the request's cache salt (the tenant's), so one tenant can neither reach nor
end another's. A worker loss resets the pool: the leases keep their TTL and lose their blocks.
The Scheduler holds one SessionLeases and calls it at finishing, schedule() and under pressure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.contract.ids import BlockId
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.request import Sequence


@dataclass(slots=True)
class Lease:
    expires_at: float
    blocks: list[BlockId] = field(default_factory=list)  # one reference each
    # What a save (snapshots.py) writes: the tokens of `blocks`, from the history's first block.
    # Empty when the lease cannot be saved: its window freed its first blocks, or it ran under a
    # LoRA adapter (a snapshot does not say which: restored, its blocks would key the base model).
    token_ids: tuple[int, ...] = ()
    # Demoted: the blocks it let go, each with its prefix-index serial then (serials are never reused,
    # so a block still registered under the same serial still holds those tokens): a save finds them.
    demoted: list[tuple[BlockId, int]] = field(default_factory=list)


def session_key(cache_salt: str | None, session_id: str) -> str:
    return f"{cache_salt or ''}\x00{session_id}"


class SessionLeases:
    def __init__(self, kv: KVCacheManager, clock: Callable[[], float]) -> None:
        self._kv = kv
        self._clock = clock
        self._leases: OrderedDict[str, Lease] = OrderedDict()  # least recently used first
        self.num_expired = 0
        self.num_demoted = 0

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.blocks) for lease in self._leases.values())

    def held_blocks(self) -> list[BlockId]:
        return [b for lease in self._leases.values() for b in lease.blocks]

    def finishing(self, seq: Sequence) -> None:
        """`seq`, running, is finishing: if its request names a session, the lease takes its
        registered blocks (before they drop) and lets go of the previous turn's."""
        req = seq.request
        if req.session_id is None or self._kv.index is None or seq.seq_index or req.beam is not None:
            return
        blocks = seq.block_table[seq.num_window_freed:min(seq.num_registered_blocks, len(seq.block_table))]
        self._kv.share(blocks)  # first: the previous turn's blocks are mostly these
        key = session_key(req.cache_salt, req.session_id)
        lease = self._leases.pop(key, None)
        if lease is not None:
            self._kv.release(lease.blocks, None)
        savable = not seq.num_window_freed and req.lora is None
        tokens = tuple(seq.token_ids[:len(blocks) * self._kv.block_size]) if savable else ()
        self._leases[key] = Lease(self._clock() + req.session_ttl, blocks, tokens)

    def get(self, cache_salt: str | None, session_id: str) -> Lease | None:
        return self._leases.get(session_key(cache_salt, session_id))

    def expire(self) -> None:
        """End the leases whose TTL has passed (every schedule(): O(1) when none has)."""
        if not self._leases:
            return
        now = self._clock()
        for key in [k for k, lease in self._leases.items() if lease.expires_at <= now]:
            self._kv.release(self._leases.pop(key).blocks, None)
            self.num_expired += 1

    def end(self, cache_salt: str | None, session_id: str) -> bool:
        """End one session now; False when it has no lease (unknown, expired or ended)."""
        lease = self._leases.pop(session_key(cache_salt, session_id), None)
        if lease is None:
            return False
        self._kv.release(lease.blocks, None)
        return True

    def demote_one(self, tenant: str | None = None) -> bool:
        """Pressure: the least recently used lease holding blocks (holding blocks `tenant` owns,
        when its KV cap is what is short: a lease is charged to the tenant whose blocks it holds,
        block_pool.py) lets them go to the evictable LRU (and from there, when evicted, to the host
        tier). False when no such lease holds any."""
        owner = self._kv.pool.owner
        for lease in self._leases.values():
            if lease.blocks and (tenant is None or any(owner(b) == tenant for b in lease.blocks)):
                index = self._kv.index
                # (a block whose content another block had registered first is not in the index: -1)
                lease.demoted = [(b, index.serial_of(b) if index.is_cached(b) else -1) for b in lease.blocks] \
                    if index is not None else []
                self._kv.release(lease.blocks, None)
                lease.blocks = []
                self.num_demoted += 1
                return True
        return False

    def reset(self) -> None:
        """The pool was reset (worker loss): the references are gone, the leases and TTLs stay."""
        for lease in self._leases.values():
            lease.blocks, lease.token_ids, lease.demoted = [], (), []

