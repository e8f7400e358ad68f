"""Tenants in the scheduler: KV caps, fair-share admission (virtual token counters) and their totals.

A request carries its tenant (the gateway's API-key tenant, "" anonymous). Two policies, both off
by default, and the per-tenant figures the metrics report either way:

- **KV caps.** A tenant may hold at most its cap of device blocks: `--tenant-kv-share F` of the pool
  (a request's `kv_share`, from the keys file, sets its tenant's own share). The block pool enforces
  it (block_pool.py: a tenant at its cap recycles its own cached blocks, never another tenant's),
  admission skips a tenant at its cap for the step instead of stopping behind it, and a running
  sequence short only of its tenant's room preempts that tenant's newest sequence (scheduler.py).
  A cap takes effect when the tenant holds no more than it (a lowered share waits until then), so
  held <= cap always holds (BlockPool.check).
- **Fair share (VTC**, Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).
  Each tenant has a virtual token counter that grows by the service it got: prompt tokens
  computed at admission * vtc_prompt_weight, output tokens sampled * vtc_output_weight.
  Admission takes the waiting lane of the tenant with the smallest counter (FCFS or priority
  within it, queues.py). A tenant that becomes active (its first unfinished request) after idling
  has its counter lifted to the smallest counter of the active tenants, so idle time banks no credit.

The Scheduler holds one Tenants and tells it of arrivals, admissions, sampled tokens and endings.
"""

from __future__ import annotations

import math
from collections import Counter

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.outputs import TenantStats


def share_to_blocks(share: float, num_blocks: int) -> int:
    return max(1, math.floor(share * num_blocks))


class Tenants:
    def __init__(self, pool: BlockPool, kv_share: float, fairness: str,
                 prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self._pool = pool
        pool.set_cap(None, share_to_blocks(kv_share, pool.num_blocks))
        self.fair = fairness == "vtc"
        self._wp, self._wq = prompt_weight, output_weight
        self.counters: dict[str, float] = {}  # the virtual token counters
        self.active: Counter[str] = Counter()  # unfinished requests per tenant
        self.prompt_tokens: Counter[str] = Counter()
        self.generation_tokens: Counter[str] = Counter()
        self._pending_caps: dict[str, int] = {}  # lowered caps waiting for the tenant to fit

    def cap_for(self, tenant: str, kv_share: float) -> int:
        """The cap `tenant` would have with a request of `kv_share` (0: its current one)."""
        if kv_share > 0:
            return share_to_blocks(kv_share, self._pool.num_blocks)
        return self._pool.cap_of(tenant)

    def arrive(self, tenant: str, kv_share: float) -> None:
        """A request of `tenant` was queued: its share (if any) and the counter lift."""
        if kv_share > 0:
            self._set_cap(tenant, share_to_blocks(kv_share, self._pool.num_blocks))
        elif tenant in self._pending_caps:
            self._set_cap(tenant, self._pending_caps[tenant])
        if not self.active[tenant]:
            others = [self.counters.get(t, 0.0) for t, n in self.active.items() if n and t != tenant]
            if others:
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(others))
        self.active[tenant] += 1

    def _set_cap(self, tenant: str, cap: int) -> None:
        pool = self._pool
        if pool.held[tenant] <= cap:
            pool.set_cap(tenant, cap)
            self._pending_caps.pop(tenant, None)
        else:  # lowered below what it holds: applied at a later arrival, once it fits
            self._pending_caps[tenant] = cap

    @property
    def single_active(self) -> str | None:
        """The one tenant with unfinished requests, or None (none, or several): with one, every
        sampled token is its (the per-token path then counts nothing per tenant)."""
        active = self.active
        return next(iter(active)) if len(active) == 1 else None

    def leave(self, tenant: str) -> None:
        """A request of `tenant` ended (every sequence)."""
        self.active[tenant] -= 1
        if not self.active[tenant]:
            del self.active[tenant]

    def admitted(self, tenant: str, num_prompt_tokens: int, num_computed: int, first: bool) -> None:
        """A sequence was admitted with `num_computed` prompt tokens to compute (past its hit);
        `first`: its request's first admission (the prompt-token total counts it once)."""
        if first:
            self.prompt_tokens[tenant] += num_prompt_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + num_computed * self._wp

    def sampled(self, per_tenant: Counter[str]) -> None:
        """Output tokens accepted in one step, per tenant."""
        self.generation_tokens.update(per_tenant)
        wq, counters = self._wq, self.counters
        for tenant, n in per_tenant.items():
            counters[tenant] = counters.get(tenant, 0.0) + n * wq

    def rank(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def stats(self, waiting: dict[str, int]) -> tuple[TenantStats, ...]:
        """Every tenant seen (arrived, holding blocks or served), by name."""
        pool = self._pool
        names = set(self.counters) | set(self.prompt_tokens) | {t for t, n in pool.held.items() if n}
        names |= set(waiting) | set(self.active)
        return tuple(TenantStats(t, pool.held[t], pool.cap_of(t), self.prompt_tokens[t],
                                 self.generation_tokens[t], waiting.get(t, 0), self.counters.get(t, 0.0))
                     for t in sorted(names))
