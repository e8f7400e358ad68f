"""Several scheduler replicas behind the one EngineClient interface the handlers already use.

`ReplicaSet` owns one EngineClient per scheduler, a background refresher per replica (grpc.health
+ GetStats every `stats_interval_s`: the router's load, and the circuit breaker's probe), and
routes each `generate` with gateway/upstream/routing.py. Failover: a replica that fails a request with
UNAVAILABLE (or RESOURCE_EXHAUSTED, queue full) before any token was streamed has it re-submitted
to another replica, transparently. A stream already under way whose replica fails (UNAVAILABLE:
connection lost, scheduler gone, or its worker lost) goes on on another replica (mid-stream
failover, `continuation`): the prompt plus the tokens already streamed, marked as earlier output
(`num_prior_output_tokens`), with max_tokens / min_tokens reduced by them, so greedy and seeded
streams continue with exactly the tokens the first replica would have sampled. Request errors
(INVALID_ARGUMENT, INTERNAL: a poison request) and the caller leaving are never failed over.
Every replica is tried at most once per request, and at most `max_stream_failovers` continuations;
then the error ends the stream (the handlers render it as before). Aborts go to the replica that
holds the request. Ready when at least one replica serves.

Live migration (`migrate`, `drain`; gateway/upstream/migration.py): a stream whose replica ends it
with MIGRATED goes on on the target as the same continuation, carrying the exported KV handoff
(`kv_import`), so the target computes no prefill; it counts neither as a failover nor as a try.
A drained replica leaves the rotation until `undrain`.

Membership (`--scheduler dns:///NAME:PORT`, gateway/upstream/dns_discovery.py): `apply_membership`
makes the set equal to a DNS answer. A new address joins the routing at once; an address that left
the answer is retired: out of rotation as a drain, its streams under way finish there, and once it
holds none its channel closes (it keeps its index, and gets a fresh channel if it comes back).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from gateway import metrics
from gateway.errors import UpstreamError
from gateway.upstream.dns_discovery import DnsDiscovery, Reconcile, reconcile
from gateway.upstream.engine_client import EngineClient
from gateway.upstream.migration import Moves, migrated_handoff
from gateway.upstream.routing import BreakerState, CircuitBreaker, Router, RoutingConfig, routing_key
from gateway.upstream.session_homes import SessionHomes
from pagoda.contract.common_codec import lora_from_pb
from pagoda.runtime.logging import get_logger
from pagoda.v1 import engine_pb2

log = get_logger(__name__)
# Failures before the first token that another replica may take over. UNAVAILABLE also opens the
# breaker; RESOURCE_EXHAUSTED (that replica's queue is full) is load, not a fault.
_RESUBMIT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def can_continue(request: engine_pb2.GenerateRequest, produced: Sequence[int]) -> bool:
    """Whether a stream of `request` can move on after `produced`: one sequence (n > 1 and beam
    search keep several, which one prompt cannot carry on) with tokens left to sample."""
    sampling = request.sampling
    if (sampling.n if sampling.HasField("n") else 1) != 1 or sampling.beam_width:
        return False
    return not sampling.HasField("max_tokens") or sampling.max_tokens > len(produced)


def continuation(request: engine_pb2.GenerateRequest, produced: Sequence[int]) -> engine_pb2.GenerateRequest:
    """`request` carried on after `produced` (sequence 0's tokens already streamed): they join the
    prompt as earlier output, which the worker counts as output (the seeded sampler's position,
    frequency / presence penalties, bad words, grammar), while the new limits count new tokens."""
    carried = engine_pb2.GenerateRequest()
    carried.CopyFrom(request)
    carried.prompt_token_ids.extend(produced)
    carried.num_prior_output_tokens = request.num_prior_output_tokens + len(produced)
    sampling = carried.sampling
    if sampling.HasField("max_tokens"):  # absent: up to the context, the same total either way
        sampling.max_tokens -= len(produced)
    sampling.min_tokens = max(0, sampling.min_tokens - len(produced))
    sampling.ClearField("prompt_logprobs")  # streamed with the first token already
    return carried


def _as_continued(response: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
    """A continuation's response with its prompt facts dropped: the caller keeps the first
    replica's (the original prompt's tokens and cache hits, its queue time)."""
    response.num_prompt_tokens = response.num_cached_tokens = 0
    response.queue_seconds = 0.0
    del response.prompt_logprobs[:]
    return response


class Replica:
    __slots__ = ("index", "client", "breaker", "label", "serving", "retiring", "closed")

    def __init__(self, index: int, client: EngineClient, breaker: CircuitBreaker) -> None:
        self.index, self.client, self.breaker, self.label = index, client, breaker, str(index)
        self.serving = False  # its last health check said SERVING
        self.retiring = False  # it left the DNS answer: no new request; those under way finish
        self.closed = False  # retired and holding no stream: its channel is closed

    @property
    def in_set(self) -> bool:
        return not (self.retiring or self.closed)

    def state(self, drained: set[int]) -> str:
        if self.closed:
            return "removed"
        if self.retiring or self.index in drained:
            return "draining"
        return "serving" if self.serving and self.breaker.closed else "down"


class ReplicaSet:
    """Create inside the event loop; `start()` begins the background refresh (wait_for_info does)."""

    def __init__(self, targets: Sequence[str], routing: RoutingConfig, timeout_s: float = 5.0,
                 tls_ca: str | None = None, clock: Callable[[], float] = time.monotonic,
                 clients: Sequence[EngineClient] | None = None, labels: Sequence[str] | None = None,
                 discovery: DnsDiscovery | None = None) -> None:
        """`labels`: each replica's metric label (default its index; model pools pass the position
        of its scheduler in --scheduler, unique across pools). `discovery`: the replicas are a DNS
        name's addresses (`targets` empty; each one's label is its address)."""
        if len(targets) < 1 and discovery is None:
            raise ValueError("a replica set needs at least one scheduler")
        self._timeout_s, self._tls_ca, self._clock = timeout_s, tls_ca, clock
        clients = clients or [EngineClient(t, timeout_s, tls_ca=tls_ca) for t in targets]
        self.replicas = [Replica(i, c, CircuitBreaker(routing.breaker_failures, routing.breaker_cooldown_s,
                                                      clock)) for i, c in enumerate(clients)]
        for replica, label in zip(self.replicas, labels or (), strict=False):
            replica.label = label
        self.router = Router(targets, routing)
        self.target = str(discovery.target) if discovery is not None else ",".join(targets)
        self.discovery = discovery
        self._discovering: asyncio.Task | None = None
        self._known = asyncio.Event()  # at least one replica (set at once without discovery)
        if self.replicas:
            self._known.set()
        self._closing: set[asyncio.Task] = set()  # retired replicas' channels being closed
        self.block_size = 0  # from GetInfo; 0 (no key) until a replica answered
        self._config = routing
        self._holders: dict[str, Replica] = {}  # request id -> the replica streaming it
        self._moves = Moves()  # live migrations asked and not complete yet
        self.drained: set[int] = set()  # out of rotation (drain): new requests go elsewhere
        self.sessions = SessionHomes()  # session -> the replica holding its lease (session_homes.py)
        self._refreshers: dict[int, asyncio.Task] = {}  # replica index -> its refresher
        self._started = False
        for replica in self.replicas:
            metrics.REPLICA_UP.labels(replica.label).set(1)

    def start(self) -> None:
        if not self._started:
            self._started = True
            for replica in self.replicas:
                self._refreshers[replica.index] = asyncio.create_task(self._refresh_forever(replica))
            if self.discovery is not None:
                self._discovering = asyncio.create_task(self.discovery.run(self.apply_membership))

    async def close(self) -> None:
        tasks = [*self._refreshers.values(), *([self._discovering] if self._discovering else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for replica in self.replicas:
            if not replica.closed:
                await replica.client.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    # -- membership (DNS discovery) ------------------------------------------------------------

    def apply_membership(self, targets: frozenset[str]) -> Reconcile:
        """Make the replicas in the set equal to `targets` (a DNS answer): add, rejoin, retire."""
        change = reconcile((r.client.target for r in self.replicas if r.in_set), targets)
        known = {r.client.target: r for r in self.replicas}
        for target in change.add:
            if target in known:
                self._rejoin(known[target])
            else:
                self.add_replica(target)
        for target in change.drain:
            self.retire_replica(known[target].index)
        return change

    def add_replica(self, target: str, label: str | None = None) -> Replica:
        """A new replica (index: the next one), in rotation at once; `label` defaults to `target`."""
        breaker = CircuitBreaker(self._config.breaker_failures, self._config.breaker_cooldown_s, self._clock)
        replica = Replica(len(self.replicas), EngineClient(target, self._timeout_s, tls_ca=self._tls_ca), breaker)
        replica.label = label or target
        self.replicas.append(replica)
        self.router.add(target)
        self._known.set()
        self._joined(replica)
        return replica

    def _rejoin(self, replica: Replica) -> None:
        """A retired replica back in the answer: under way, it just stays; closed, a new channel."""
        replica.retiring = False
        if replica.closed:
            replica.closed, replica.serving = False, False
            replica.client = EngineClient(replica.client.target, self._timeout_s, tls_ca=self._tls_ca)
            replica.breaker = CircuitBreaker(self._config.breaker_failures, self._config.breaker_cooldown_s,
                                             self._clock)
        self._joined(replica)

    def _joined(self, replica: Replica) -> None:
        metrics.REPLICA_UP.labels(replica.label).set(1)
        if self._started and replica.index not in self._refreshers:
            self._refreshers[replica.index] = asyncio.create_task(self._refresh_forever(replica))
        log.info("replica_joined", replica=replica.index, target=replica.client.target)

    def retire_replica(self, index: int) -> None:
        """Out of rotation for good (it left the answer): the streams it serves finish there,
        then its channel closes (`_close_if_idle`, called as each stream leaves it)."""
        replica = self.replicas[index]
        replica.retiring = True
        log.info("replica_draining", replica=index, target=replica.client.target,
                 in_flight=sum(h is replica for h in self._holders.values()))
        self._close_if_idle(replica)

    def _close_if_idle(self, replica: Replica) -> None:
        if not replica.retiring or replica.closed or any(h is replica for h in self._holders.values()):
            return
        replica.retiring, replica.closed = False, True
        refresher = self._refreshers.pop(replica.index, None)
        if refresher is not None:
            refresher.cancel()
        closing = asyncio.create_task(replica.client.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        with contextlib.suppress(KeyError):  # no series for a replica that is gone
            metrics.REPLICA_UP.remove(replica.label)
        log.info("replica_removed", replica=replica.index, target=replica.client.target)

    def describe(self) -> list[dict]:
        """Every replica as the admin endpoint lists it (removed ones included: indexes stay)."""
        return [{"replica": r.index, "target": r.client.target, "label": r.label, "state": r.state(self.drained),
                 "in_flight": sum(h is r for h in self._holders.values()),
                 "breaker": r.breaker.state.value} for r in self.replicas]

    # -- health, load and the breakers -------------------------------------------------------

    async def _refresh_forever(self, replica: Replica) -> None:
        while True:
            await self.refresh(replica)
            await asyncio.sleep(self._config.stats_interval_s)

    async def refresh(self, replica: Replica) -> None:
        """One probe: health, then stats. While its breaker is open (cooling down) it is skipped;
        half-open, this probe decides."""
        if replica.breaker.state is BreakerState.OPEN or replica.closed:
            return
        replica.serving = await replica.client.is_serving()
        stats = None
        if replica.serving:
            with contextlib.suppress(UpstreamError):
                stats = await replica.client.get_stats()
        if stats is None:
            self._failed(replica, "not serving" if not replica.serving else "no stats")
            return
        self.router.on_stats(replica.index, stats.num_waiting, stats.num_running)
        self._succeeded(replica)

    def _failed(self, replica: Replica, why: str) -> None:
        if replica.breaker.record_failure():
            metrics.REPLICA_UP.labels(replica.label).set(0)
            metrics.REPLICA_BREAKER_OPENED.labels(replica.label).inc()
            log.warning("replica_breaker_opened", replica=replica.index, target=replica.client.target,
                        reason=why, cooldown_s=self._config.breaker_cooldown_s)

    def _succeeded(self, replica: Replica) -> None:
        if replica.breaker.record_success():
            metrics.REPLICA_UP.labels(replica.label).set(1)
            log.info("replica_breaker_closed", replica=replica.index, target=replica.client.target)

    def available(self, exclude: set[int] = frozenset()) -> list[int]:
        """Replicas in rotation (closed breakers); when none is, every one not excluded (a request
        then fails fast with the replica's own error rather than a made-up one)."""
        candidates = [r.index for r in self.replicas
                      if r.in_set and r.index not in exclude and r.index not in self.drained]
        closed = [i for i in candidates if self.replicas[i].breaker.closed]
        return closed or candidates

    # -- the EngineClient interface ------------------------------------------------------------

    async def generate(self, request: engine_pb2.GenerateRequest, metadata=()
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        lora = lora_from_pb(request)
        key = (routing_key(request.prompt_token_ids, request.cache_salt, self.block_size,
                           self._config.prefix_blocks, lora.cache_key if lora else None, request.mm_inputs)
               if self.block_size else None)
        try:
            async with contextlib.aclosing(self._attempts(request, metadata, key)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._moves.ended(request.request_id)  # a move asked for and not complete: it ended here

    async def _attempts(self, request: engine_pb2.GenerateRequest, metadata, key: bytes | None
                        ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        tried: set[int] = set()
        attempt = request  # the original, or its continuation after a failover or a migration
        produced: list[int] = []  # sequence 0's tokens streamed so far, on every replica
        failovers = 0
        moved_to: int | None = None  # a live migration's target, for the next attempt
        while True:
            candidates = self.available(tried)
            if moved_to is not None:  # live migration: the target asked for (or chosen) already
                chosen, reason, moved_to = moved_to, "migration", None
            elif tried:  # failover: the least-loaded of the rest, whatever the policy
                chosen, reason = self.router.least_loaded(candidates), "failover"
            elif (home := self.sessions.get(request.cache_salt, request.session_id)) in candidates:
                chosen, reason = home, "session"  # its lease (a restore's too) is there
                self.router.loads[home].routed_since_stats += 1
            else:
                chosen, reason = self.router.choose(key, candidates)
            replica = self.replicas[chosen]
            tried.add(replica.index)
            metrics.ROUTER_REQUESTS.labels(replica.label, reason).inc()
            self._holders[request.request_id] = replica
            started = False
            handoff = None
            try:
                async with contextlib.aclosing(replica.client.generate(attempt, metadata)) as stream:
                    async for response in stream:
                        handoff = migrated_handoff(response)
                        if handoff is not None:  # it left this replica: no token, no finish for the caller
                            break
                        if not started and any(d.token_ids or d.finish_reason for d in response.sequences):
                            started = True
                            self._succeeded(replica)  # it serves (the caller may stop reading early)
                            if request.session_id:  # its next turn finds its lease here
                                self.sessions.set(request.cache_salt, request.session_id, replica.index)
                            if attempt.HasField("kv_import"):
                                self._moves.resumed(request.request_id)
                        if attempt is not request:
                            _as_continued(response)
                        produced += [t for d in response.sequences if d.index == 0 for t in d.token_ids]
                        yield response
                if handoff is None:
                    return
            except UpstreamError as error:
                if error.grpc_code == grpc.StatusCode.UNAVAILABLE:
                    self._failed(replica, "request failed: UNAVAILABLE")
                if error.grpc_code not in _RESUBMIT:
                    raise
                # Under way: this replica streamed tokens, or a continuation's replica is gone
                # before its first (a continuation refused for load is re-submitted as it is).
                if started or (produced and error.grpc_code == grpc.StatusCode.UNAVAILABLE):
                    if (error.grpc_code != grpc.StatusCode.UNAVAILABLE or not can_continue(request, produced)
                            or failovers >= self._config.max_stream_failovers or not self.available(tried)):
                        metrics.ROUTER_STREAMS_FAILED.labels(replica.label).inc()
                        raise
                    failovers += 1
                    attempt = continuation(request, produced)
                    metrics.ROUTER_STREAM_FAILOVERS.labels(replica.label).inc()
                    log.warning("stream_failed_over", request_id=request.request_id, failed_replica=replica.index,
                                tokens_streamed=len(produced), failover=failovers, reason=str(error))
                    continue
                if not self.available(tried):  # every replica in rotation tried
                    raise
                metrics.ROUTER_RESUBMITTED.labels(replica.label).inc()
                log.info("request_resubmitted", request_id=request.request_id, failed_replica=replica.index,
                         code=error.grpc_code.name)
            finally:
                if self._holders.get(request.request_id) is replica:
                    del self._holders[request.request_id]
                self._close_if_idle(replica)  # a retired replica's last stream: its drain is complete
            if handoff is not None:
                attempt = continuation(request, produced)
                attempt.kv_import.CopyFrom(handoff)
                move = self._moves.exported(request.request_id, handoff)
                others = self.available({replica.index}) or [replica.index]
                asked = move.target if move is not None else None
                moved_to = asked if asked is not None else self.router.least_loaded(others)
                if move is not None:
                    move.chosen = moved_to
                tried.discard(moved_to)
                metrics.ROUTER_MIGRATIONS.labels(replica.label).inc()
                log.info("stream_migrated", request_id=request.request_id, source=replica.index, target=moved_to,
                         tokens_streamed=len(produced), kv_tokens=handoff.num_tokens, kv_blocks=handoff.num_blocks)

    async def abort(self, request_id: str) -> bool:
        holder = self._holders.get(request_id)
        if holder is not None:
            return await holder.client.abort(request_id)
        found = await asyncio.gather(*(r.client.abort(request_id) for r in self._open()),
                                     return_exceptions=True)
        return any(f is True for f in found)

    async def migrate(self, request_id: str, target: int | None = None, timeout_s: float = 60.0) -> dict | None:
        """Move a stream under way to `target` (None: the least loaded other replica) with its KV;
        the move's figures once the target streamed its first token. None: no replica streams it."""
        holder = self._holders.get(request_id)
        if holder is None or (target is not None and not self.replicas[target].in_set):
            return None  # nothing to move, or the target left the set (DNS)
        move = self._moves.start(request_id, target, holder.index)
        try:
            accepted = await holder.client.migrate(request_id)
        except BaseException:
            self._moves.ended(request_id)
            raise
        if not accepted:
            self._moves.ended(request_id)
            return None
        return await asyncio.wait_for(asyncio.shield(move.done), timeout_s)

    async def drain(self, index: int) -> list[dict]:
        """Take replica `index` out of rotation and move every stream it serves elsewhere (then it
        may be stopped with nothing lost); `undrain` puts it back."""
        self.drained.add(index)
        held = [rid for rid, replica in self._holders.items() if replica.index == index]
        moved = await asyncio.gather(*(self.migrate(rid) for rid in held), return_exceptions=True)
        return [m if isinstance(m, dict) else {"migrated": False, "error": str(m)} for m in moved if m is not None]

    def undrain(self, index: int) -> None:
        self.drained.discard(index)

    async def end_session(self, session_id: str, cache_salt: str) -> bool:
        """On every replica: the session's turns may have been routed to any of them."""
        self.sessions.drop(cache_salt, session_id)
        found = await asyncio.gather(*(r.client.end_session(session_id, cache_salt) for r in self._open()),
                                     return_exceptions=True)
        return any(f is True for f in found)

    async def save_session(self, session_id: str, cache_salt: str) -> engine_pb2.SessionSnapshot:
        """Saved by the replica holding its lease: its home first, then the others in turn (one at
        a time: they write one snapshot folder). NOT_FOUND when none holds it."""
        home = self.sessions.get(cache_salt, session_id)
        order = sorted(self._open(), key=lambda r: r.index != home)
        error: UpstreamError | None = None
        for replica in order:
            try:
                return await replica.client.save_session(session_id, cache_salt)
            except UpstreamError as failure:
                if failure.grpc_code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    raise
                error = error if error is not None and error.grpc_code == grpc.StatusCode.NOT_FOUND else failure
        assert error is not None
        raise error

    async def restore_session(self, session_id: str, cache_salt: str, ttl_s: float, tenant: str = "",
                              replica: int | None = None) -> tuple[engine_pb2.SessionSnapshot, int]:
        """Load the snapshot into `replica` (None: the least loaded in rotation), which becomes the
        session's home: its next turn is routed there. The answer and the replica's index."""
        index = self.router.least_loaded(self.available()) if replica is None else replica
        if not self.replicas[index].in_set:
            raise UpstreamError(grpc.StatusCode.UNAVAILABLE, f"replica {index} has left the set (DNS)")
        restored = await self.replicas[index].client.restore_session(session_id, cache_salt, ttl_s, tenant)
        self.sessions.set(cache_salt, session_id, index)
        return restored, index

    async def get_info(self) -> engine_pb2.EngineInfo:
        return await self._first(lambda r: r.client.get_info())

    async def wait_for_info(self, timeout_s: float) -> engine_pb2.EngineInfo:
        """The first replica's GetInfo to answer (startup order); starts the background refresh
        (and the discovery, whose first answer it waits for)."""
        self.start()
        await asyncio.wait_for(self._known.wait(), timeout_s)
        info = await self._first(lambda r: r.client.wait_for_info(timeout_s))
        self.block_size = info.block_size
        return info

    async def get_stats(self) -> engine_pb2.EngineStats:
        """Every answering replica's stats, summed (kv_cache_usage: used / total blocks)."""
        results = await asyncio.gather(*(r.client.get_stats() for r in self._open()), return_exceptions=True)
        answered = [s for s in results if isinstance(s, engine_pb2.EngineStats)]
        if not results:
            raise _no_replica()
        if not answered:
            raise next(e for e in results if isinstance(e, BaseException))
        return merge_stats(answered)

    async def is_serving(self) -> bool:
        """At least one replica says SERVING (answers as soon as one does: a hung replica does
        not hold /ready for its whole timeout)."""
        tasks = [asyncio.create_task(r.client.is_serving()) for r in self.replicas if r.in_set]
        try:
            for done in asyncio.as_completed(tasks):
                if await done:
                    return True
            return False
        finally:
            for task in tasks:
                task.cancel()

    def _open(self) -> list[Replica]:
        """Replicas with a channel: in the set, or retired and still finishing streams."""
        return [r for r in self.replicas if not r.closed]

    async def _first(self, call):
        tasks = [asyncio.create_task(call(r)) for r in self.replicas if r.in_set]
        error: BaseException = _no_replica()
        try:
            for done in asyncio.as_completed(tasks):
                try:
                    return await done
                except UpstreamError as failure:
                    error = failure
            raise error
        finally:
            for task in tasks:
                task.cancel()


def _no_replica() -> UpstreamError:
    return UpstreamError(grpc.StatusCode.UNAVAILABLE, "the scheduler is unavailable: no replica is known yet")


def merge_stats(stats: Sequence[engine_pb2.EngineStats]) -> engine_pb2.EngineStats:
    """Counters and gauges summed, flags and-ed, kv_cache_usage recomputed from the block counts."""
    merged = engine_pb2.EngineStats()
    for field in engine_pb2.EngineStats.DESCRIPTOR.fields:
        name = field.name
        values = [getattr(s, name) for s in stats]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for value in values:
                for key, count in value.items():
                    getattr(merged, name)[key] += count
        elif field.is_repeated:
            width = max(len(v) for v in values)
            getattr(merged, name).extend(sum(v[i] for v in values if i < len(v)) for i in range(width))
        elif field.type == field.TYPE_BOOL:
            setattr(merged, name, all(values))
        else:
            setattr(merged, name, sum(values))
    if merged.num_total_blocks:
        merged.kv_cache_usage = merged.num_used_blocks / merged.num_total_blocks
    else:
        merged.kv_cache_usage = max(s.kv_cache_usage for s in stats)
    return merged
