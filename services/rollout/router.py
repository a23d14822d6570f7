"""Client-side routing over rollout replicas (the coordinator generates through this).

    router = RolloutRouter(["10.0.0.1:50051", "10.0.0.2:50051"])
    await router.start()                       # optional: probe failed replicas back in
    samples = await router.generate(prompts, SamplingSpec(n=8, max_tokens=256), chunk_prompts=16)

- Spreading: each request (or chunk of `chunk_prompts` prompts) goes to the healthy replica with
  the fewest requests this router has outstanding on it, ties broken by the queue depth it last
  reported, then round-robin.
- Failover: a replica that fails with UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED (connection
  refused, server gone, stuck) is taken out and the work goes to another one. A request streams
  its samples, so samples that already finished are kept and only the missing ones are sent again
  (same sampling parameters; with a seed they are drawn again on the new replica).
- Hedging (hedge_after > 0): once half of a request's parts have finished, a part still running after
  hedge_after times their median duration is sent once more, its missing samples only, to another replica. The
  first copy of each sample to arrive is delivered and the other dropped; once every sample has arrived, what
  still runs is cancelled. So one stalled or 10x slow replica holds a step for about hedge_after
  times a part's usual time, not its own, and a stream stuck on a dead link needs no keepalive to end.
- Routing keys: a request with a routing_key (an agent episode's, rlfabric.gateway) goes to the replica its
  key's first request went to, while that replica is healthy, so the episode's growing prompt stays in one
  prefix cache; release(key) forgets it.
- Counting: `stats` (RouterStats) has the samples asked for and delivered, those a failed replica had in flight
  and those sent again because of it, and any delivered twice (dropped: each sample reaches the caller once).
- Probing: a background task (start()) health-checks replicas that are out and puts them back
  when they report readiness SERVING; with no healthy replica left, the router probes once before
  giving up with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health_pb2

from rlfabric.core.client import ChannelOptions, check_health
from rlfabric.core.errors import RlfabricError, Unavailable
from rlfabric.rollout.client import RolloutClient, RolloutInterface
from rlfabric.rollout.types import EngineStatus, FinishedSample, SamplingSpec
from rlfabric.rollout.wire import PromptInput, sample_order

log = logging.getLogger("rlfabric.router")
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


@dataclass
class _NoRetryOptions(ChannelOptions):
    """Channel options without gRPC's transparent retries: failover is the router's job. (A retry
    policy with maxAttempts 1 is an invalid service config, so the policy is left out instead.)"""

    def grpc_options(self):
        return [(k, v) for k, v in super().grpc_options() if k != "grpc.service_config"]


@dataclass(eq=False)
class Replica:
    """One rollout replica as the router sees it."""

    address: str
    client: RolloutInterface
    healthy: bool = True
    outstanding: int = 0  # requests this router has in flight on it
    queue_depth: int = 0  # as last reported by GetStatus
    last_error: str = ""
    down_since: float = 0.0
    excluded: bool = False  # taken out by the coordinator (e.g. stale weights): probing does not bring it back


@dataclass
class RouterStats:
    """Sample counts since the router was made (as metrics: rollout/router/<name>)."""

    requested_samples: int = 0  # samples asked of generate_stream
    delivered_samples: int = 0  # samples handed to the caller (each (prompt, sample) once)
    duplicate_samples: int = 0  # samples that arrived for a (prompt, sample) already delivered, dropped
    failovers: int = 0  # requests a replica failed with a failover code
    failed_inflight_samples: int = 0  # samples a replica had been sent and not delivered when it failed
    rework_samples: int = 0  # samples sent again to another replica because theirs failed
    hedges: int = 0  # parts sent again because they ran past hedge_after times the median part
    hedged_samples: int = 0  # samples those hedges asked for

    def since(self, earlier: RouterStats) -> RouterStats:
        """The counts between `earlier` (a copy of these stats) and now."""
        return RouterStats(**{name: value - getattr(earlier, name) for name, value in vars(self).items()})

    def as_metrics(self) -> dict[str, float]:
        return {"rollout/router/requested_samples": float(self.requested_samples),
                "rollout/router/delivered_samples": float(self.delivered_samples),
                "rollout/router/duplicate_samples": float(self.duplicate_samples),
                "rollout/router/failovers": float(self.failovers),
                "rollout/router/failed_inflight_samples": float(self.failed_inflight_samples),
                "rollout/router/rework_samples": float(self.rework_samples),
                "rollout/router/hedges": float(self.hedges),
                "rollout/router/hedged_samples": float(self.hedged_samples)}


@dataclass
class _Part:
    """A piece of a request: which original prompts, and which of their sample indices are wanted."""

    prompt_indices: list[int]
    sample_indices: list[int]  # the same for every prompt of the part
    attempts: int = 0

    @property
    def size(self) -> int:
        return len(self.prompt_indices) * len(self.sample_indices)


@dataclass(eq=False)
class _Attempt:
    """A part running on one replica."""

    part: _Part
    replica: Replica
    started: float
    hedged: bool = False


@dataclass
class _Progress:
    """What one request has received so far, and (for hedging) what runs and how long finished parts took."""

    received: set[tuple[int, int]] = field(default_factory=set)
    running: set[_Attempt] = field(default_factory=set)
    finished_s: list[float] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class RolloutRouter:
    def __init__(self, addresses: Sequence[str], options: ChannelOptions | None = None,
                 probe_interval_s: float = 2.0, max_attempts: int = 3,
                 clients: Sequence[RolloutInterface] | None = None, hedge_after: float = 0.0):
        """One replica per address, reached over gRPC, or through `clients` (one per address, e.g.
        in-process LocalRolloutClients, the addresses then only naming them). hedge_after: see the module's
        docstring; 0 = no hedging."""
        if not addresses:
            raise ValueError("RolloutRouter needs at least one rollout address")
        options = _NoRetryOptions(**{**vars(options or ChannelOptions()), "retry_max_attempts": 1})
        clients = clients or [RolloutClient(a, options) for a in addresses]
        self.replicas = [Replica(a, c) for a, c in zip(addresses, clients, strict=True)]
        self.options = options
        self.probe_interval_s = probe_interval_s
        self.max_attempts = max_attempts
        self.hedge_after = hedge_after
        self._round_robin = itertools.count()
        self._prober: asyncio.Task | None = None
        self._sticky: dict[str, Replica] = {}  # routing key -> the replica its requests go to
        self._retired: list[Replica] = []  # removed replicas, whose clients close with the router
        self.stats = RouterStats()

    # -- replica choice ------------------------------------------------------------------------

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and not r.excluded]

    def exclude(self, address: str) -> None:
        """Takes a replica out until admit(address), whatever its health says (the coordinator does
        this to a replica that missed a weight sync, so it never serves stale weights)."""
        replica = self._replica(address)
        if not replica.excluded:
            replica.excluded = True
            log.warning("rollout replica excluded", extra={"fields": {"address": address}})

    def admit(self, address: str) -> None:
        """Puts an excluded replica back (it has the current weights again)."""
        replica = self._replica(address)
        if replica.excluded:
            replica.excluded, replica.healthy, replica.last_error = False, True, ""
            log.info("rollout replica admitted", extra={"fields": {"address": address}})

    def add(self, address: str, client: RolloutInterface | None = None, excluded: bool = True) -> None:
        """A replica that joined the fleet (rlfabric.coordinator.membership). `excluded` (the default): it takes
        no request until admit(address), which the weight sync does once it holds the current weights."""
        if address in self.addresses:
            return
        self.replicas.append(Replica(address, client or RolloutClient(address, self.options), excluded=excluded))
        log.info("rollout replica added", extra={"fields": {"address": address, "excluded": excluded}})

    def remove(self, address: str) -> None:
        """A replica that left the fleet takes no new request. Requests in flight on it go on (a draining replica
        finishes them; a dead one fails over); its client closes with the router."""
        replica = self._replica(address)
        self.replicas.remove(replica)
        self._retired.append(replica)
        self._sticky = {key: kept for key, kept in self._sticky.items() if kept is not replica}
        log.info("rollout replica removed", extra={"fields": {"address": address}})

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    def client_of(self, address: str) -> RolloutInterface | None:
        """The router's client of the replica at `address` (None when it has none), for others that talk to the
        same replica (the weight-sync plane) so that each replica has one client."""
        return next((r.client for r in self.replicas if r.address == address), None)

    def excluded(self) -> list[str]:
        return [r.address for r in self.replicas if r.excluded]

    def _replica(self, address: str) -> Replica:
        for replica in self.replicas:
            if replica.address == address:
                return replica
        raise KeyError(f"no rollout replica {address!r} in this router")

    async def _pick(self, routing_key: str = "", avoid: Replica | None = None) -> Replica:
        """The replica of routing_key while it is healthy, else the least busy healthy one (then the key's);
        not `avoid` while another is healthy."""
        kept = self._sticky.get(routing_key) if routing_key else None
        if kept is not None and kept.healthy and not kept.excluded:
            return kept
        candidates = self.healthy()
        if not candidates:
            await self.probe()
            candidates = self.healthy()
        if not candidates:
            errors = "; ".join(f"{r.address}: {r.last_error}" for r in self.replicas)
            raise Unavailable(f"no healthy rollout replica ({errors})")
        skip = avoid if len(candidates) > 1 else None
        # One pass over the replicas (a list.index per candidate made each pick O(replicas^2)).
        turn, count = next(self._round_robin), len(self.replicas)
        _, chosen = min(((r.outstanding, r.queue_depth, (index - turn) % count), r)
                        for index, r in enumerate(self.replicas) if r.healthy and not r.excluded and r is not skip)
        if routing_key:
            self._sticky[routing_key] = chosen
        return chosen

    def release(self, routing_key: str) -> None:
        """Forgets routing_key's replica (its episode ended)."""
        self._sticky.pop(routing_key, None)

    def _take_out(self, replica: Replica, error: RlfabricError) -> None:
        replica.healthy = False
        replica.down_since = time.monotonic()
        replica.last_error = str(error)
        log.warning("rollout replica out", extra={"fields": {"address": replica.address, "error": replica.last_error}})

    async def probe(self) -> None:
        """Health-checks the replicas that are out; those reporting readiness SERVING come back."""

        async def check(replica: Replica) -> None:
            try:
                if isinstance(replica.client, RolloutClient):
                    status = await check_health(replica.client.channel, "readiness", timeout_s=2.0)
                else:  # an engine in this process: back when it answers
                    await replica.client.status(timeout_s=2.0)
                    status = health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as error:
                replica.last_error = f"{error.code().name}: {error.details()}"
                return
            if status == health_pb2.HealthCheckResponse.SERVING:
                replica.healthy, replica.last_error = True, ""
                log.info("rollout replica back", extra={"fields": {"address": replica.address}})

        await asyncio.gather(*(check(r) for r in self.replicas if not r.healthy and not r.excluded))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self.probe()

    async def start(self) -> None:
        """Starts probing failed replicas every probe_interval_s."""
        if self._prober is None:
            self._prober = asyncio.create_task(self._probe_forever(), name="rollout-router-prober")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            self._prober = None
        await asyncio.gather(*(r.client.close() for r in [*self.replicas, *self._retired]))

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, prompts: Sequence[PromptInput], params: SamplingSpec, chunk_prompts: int | None = None,
                       timeout_s: float | None = None, routing_key: str = "") -> list[FinishedSample]:
        """Every sample, ordered by (prompt_index, sample_index)."""
        samples = [s async for s in self.generate_stream(prompts, params, chunk_prompts, timeout_s, routing_key)]
        return sorted(samples, key=sample_order)

    async def generate_stream(self, prompts: Sequence[PromptInput], params: SamplingSpec,
                              chunk_prompts: int | None = None, timeout_s: float | None = None,
                              routing_key: str = "") -> AsyncIterator[FinishedSample]:
        """Each sample once, as soon as it finishes, with indices of the original request; the parts of a
        request with a routing_key go to that key's replica."""
        size = chunk_prompts or max(1, len(prompts))
        parts = [_Part(list(range(i, min(i + size, len(prompts)))), list(range(params.n)))
                 for i in range(0, len(prompts), size)] or [_Part([], list(range(params.n)))]
        out: asyncio.Queue = asyncio.Queue()
        progress = _Progress()
        total = sum(part.size for part in parts)
        self.stats.requested_samples += total
        tasks = {asyncio.create_task(self._run_part(part, prompts, params, timeout_s, progress, out,
                                                      routing_key)) for part in parts}
        running, delivered, hedged = len(tasks), 0, False

        def hedge(attempt: _Attempt) -> None:
            nonlocal running, hedged
            hedged = True
            for part in self._missing(attempt.part, progress, attempts=attempt.part.attempts):
                self.stats.hedges += 1
                self.stats.hedged_samples += part.size
                running += 1
                tasks.add(asyncio.create_task(self._run_part(part, prompts, params, timeout_s, progress, out,
                                                             routing_key, avoid=attempt.replica)))

        if self.hedge_after > 0 and len(parts) > 1:
            tasks.add(asyncio.create_task(self._hedge(progress, len(parts), hedge)))
        try:
            # Streams end on their own (a cancelled one is an error on its replica), unless a hedge left one that
            # every sample has come without: that one is cancelled once the last sample arrived.
            while running and not (hedged and delivered == total):
                item = await out.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    delivered += 1
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _hedge(self, progress: _Progress, parts: int, hedge) -> None:
        """Hedges each attempt still running past hedge_after times the median finished part, once half of the
        request's parts have finished: waits for the next part to finish or the next attempt to become due."""
        while True:
            progress.changed.clear()
            wait_s = None
            if len(progress.finished_s) * 2 >= parts:
                allowed = self.hedge_after * statistics.median(progress.finished_s)
                now = time.monotonic()
                for attempt in [a for a in progress.running if not a.hedged]:
                    due = attempt.started + allowed - now
                    if due <= 0:
                        attempt.hedged = True
                        hedge(attempt)
                    else:
                        wait_s = due if wait_s is None else min(wait_s, due)
            try:
                await asyncio.wait_for(progress.changed.wait(), wait_s)
            except TimeoutError:
                pass

    async def _run_part(self, part: _Part, prompts, params: SamplingSpec, timeout_s, progress: _Progress,
                        out: asyncio.Queue, routing_key: str = "", avoid: Replica | None = None) -> None:
        """Runs one part to completion on some replica (not `avoid`, a hedge's slow one, while there is another),
        re-sending what a failed replica left unfinished."""
        try:
            pending = [part]
            while pending:
                part = pending.pop()
                replica = await self._pick(routing_key, avoid)
                sub_prompts = [prompts[i] for i in part.prompt_indices]
                sub_params = replace(params, n=len(part.sample_indices))
                replica.outstanding += 1
                arrived = 0
                attempt = _Attempt(part, replica, time.monotonic())
                progress.running.add(attempt)
                try:
                    async for sample in replica.client.generate_stream(sub_prompts, sub_params, timeout_s):
                        key = (part.prompt_indices[sample.prompt_index], part.sample_indices[sample.sample_index])
                        arrived += 1
                        if key in progress.received:
                            self.stats.duplicate_samples += 1
                            continue
                        sample.prompt_index, sample.sample_index = key
                        progress.received.add(key)
                        self.stats.delivered_samples += 1
                        out.put_nowait(sample)
                    progress.finished_s.append(time.monotonic() - attempt.started)
                except RlfabricError as error:  # it names the replica
                    if error.code not in FAILOVER_CODES:
                        raise
                    self._take_out(replica, error)
                    self.stats.failovers += 1
                    self.stats.failed_inflight_samples += part.size - arrived
                    if part.attempts + 1 >= self.max_attempts:
                        raise Unavailable(f"generation failed on {part.attempts + 1} replicas; last: "
                                          f"{replica.last_error}") from None
                    missing = self._missing(part, progress)
                    self.stats.rework_samples += sum(p.size for p in missing)
                    pending.extend(missing)
                finally:
                    replica.outstanding -= 1
                    progress.running.discard(attempt)
                    progress.changed.set()
            out.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            out.put_nowait(error)

    @staticmethod
    def _missing(part: _Part, progress: _Progress, attempts: int | None = None) -> list[_Part]:
        """The samples of `part` not received yet, grouped into parts by their missing sample indices (each a
        retry of `part`: one more attempt, unless `attempts` says how many)."""
        by_missing: dict[tuple[int, ...], list[int]] = {}
        for p in part.prompt_indices:
            missing = tuple(s for s in part.sample_indices if (p, s) not in progress.received)
            if missing:
                by_missing.setdefault(missing, []).append(p)
        attempts = part.attempts + 1 if attempts is None else attempts
        return [_Part(ps, list(missing), attempts) for missing, ps in by_missing.items()]

    # -- fleet ---------------------------------------------------------------------------------

    async def status(self) -> dict[str, EngineStatus | str]:
        """Each replica's status (and the queue depth used for routing), or the error it gave."""

        async def one(replica: Replica):
            try:
                status = await replica.client.status(timeout_s=5.0)
            except RlfabricError as error:
                return str(error)
            replica.queue_depth = status.queue_depth
            return status

        results = await asyncio.gather(*(one(r) for r in self.replicas))
        return {r.address: result for r, result in zip(self.replicas, results, strict=True)}
