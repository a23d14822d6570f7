"""Faults at scale: one generation step over N simulated rollout replicas (rollout.engine sim) while 10% of them are
killed mid-step, 5% are 10x stragglers and one loses its network for 30 simulated seconds. Writes
bench/results/scale_faults.json.

    python -m bench.scale_faults_bench                        # 256 replicas (make bench BENCH=scale_faults)
    python -m bench.scale_faults_bench --replicas 48 --time-scale 0.05  # tests/rollout/test_sim_faults.py's step

Every replica is a real gRPC server (RlfabricServer, the sim engine behind the real RolloutService) on a port of its
own, all in this process; the real RolloutRouter reaches them over loopback gRPC. The faults are what a cluster shows
the router:
    kill       the replica's server stops with no grace: its open GenerateStream calls end (CANCELLED or
               UNAVAILABLE) and new connections are refused, as when its process dies; it restarts on the same
               port after the step, and the router's prober must admit it again
    straggler  sim.rollout.straggler_fraction of the replicas run sim.rollout.straggler_slowdown times slower
    drop       the router reaches one replica through a TCP relay that stops moving bytes both ways for the window
               (a black-holed link: no reset, no error, the bytes wait), then moves them again
Simulated time is sim.time_scale real seconds a second, the drop's window included; gRPC's keepalive (30 s + 10 s
timeout) is not scaled, so a drop shorter than it (as a real 30 s drop is) stalls that replica's streams and ends
with no failover.

Per step it records the samples requested and delivered, those delivered twice (by (prompt, sample)), those lost,
the requests failed over, the samples the killed replicas had in flight (as the router counts them when their
calls fail: sent, not delivered; as their engines counted them at the strike and when they stopped: queued or
generating) and the rework (samples sent again).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import time
from collections import Counter
from pathlib import Path

from rlfabric.core.config import RunConfig, load_config
from rlfabric.core.server import RlfabricServer, ServerOptions
from rlfabric.rollout.router import RolloutRouter
from rlfabric.rollout.servicer import build_service
from rlfabric.rollout.types import SamplingSpec
from rlfabric.sim.latency import stragglers

RESULTS = Path(__file__).parent / "results" / "scale_faults.json"
RELAY_CHUNK = 1 << 16


def log(message: str) -> None:
    print(f"[scale_faults_bench] {message}", flush=True)


@dataclasses.dataclass
class FaultPlan:
    """One step's size and faults."""

    replicas: int = 256
    prompts_per_replica: int = 4
    n: int = 8  # samples per prompt
    max_tokens: int = 1024  # responses of ~512 tokens (lognormal, mean half of it)
    chunk_prompts: int = 2  # prompts per request
    kill_fraction: float = 0.1
    straggler_fraction: float = 0.05
    straggler_slowdown: float = 10.0
    drop_s: float = 30.0  # simulated seconds the dropped replica's link moves nothing
    # At 256 replicas in one process on two cores the router reads ~400 samples/s: a smaller scale lets the
    # engines finish long before their samples are read, and a kill then strikes samples in transit, not in generation.
    time_scale: float = 0.5
    fault_at: float = 0.25  # the faults strike when this fraction of the samples has arrived
    seed: int = 0

    def config(self) -> RunConfig:
        return load_config(
            None,
            [
                "rollout.engine=sim",
                f"rollout.replicas={self.replicas}",
                f"sim.time_scale={self.time_scale}",
                f"sim.seed={self.seed}",
                f"sim.rollout.straggler_fraction={self.straggler_fraction}",
                f"sim.rollout.straggler_slowdown={self.straggler_slowdown}",
                "sim.rollout.decode_text=false",
            ],
        )


class Relay:
    """A TCP relay in front of one server; drop() black-holes it (bytes stop both ways, connections stay open)
    until restore()."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self.open = asyncio.Event()
        self.open.set()
        self.moved_while_dropped = 0  # bytes relayed during a drop: 0 unless the relay leaks
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def drop(self) -> None:
        self.open.clear()

    def restore(self) -> None:
        self.open.set()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(RELAY_CHUNK):
                await self.open.wait()  # a chunk read as the link drops waits with the rest
                if not self.open.is_set():
                    self.moved_while_dropped += len(data)
                sink.write(data)
                await sink.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            sink.close()

    async def close(self) -> None:
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class SimFleet:
    """`config.rollout.replicas` sim replicas, each a RlfabricServer on a port of its own in this process."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.options = ServerOptions(metrics_port=None, grace_period_s=0.0)
        self.servers: list[RlfabricServer] = []

    async def start(self) -> None:
        self.servers = [
            RlfabricServer(build_service(self.config, replica=i), self.options)
            for i in range(self.config.rollout.replicas)
        ]
        await asyncio.gather(*(server.start() for server in self.servers))

    @property
    def ports(self) -> list[int]:
        return [server.port for server in self.servers]

    def rows_in_flight(self, replica: int) -> int:
        return self.servers[replica].service.engine.rows_in_flight

    async def kill(self, replica: int) -> int:
        """Stops the replica's server with no grace: its streams end mid-flight, its port refuses connections. The
        samples its engine had not finished, none of them delivered: those of the streams the stop cancelled, and
        those left when the engine stopped after the server (which of the two depends on when the loop ran the
        cancellations)."""
        engine = self.servers[replica].service.engine
        abandoned = engine.abandoned_rows
        await self.servers[replica].stop(grace=0)
        return engine.abandoned_rows - abandoned + engine.unfinished_at_stop

    async def restart(self, replica: int) -> None:
        """A fresh engine and server for the replica, on its old port."""
        port = self.servers[replica].port
        server = RlfabricServer(
            build_service(self.config, replica=replica), dataclasses.replace(self.options, port=port)
        )
        await server.start()
        self.servers[replica] = server

    async def stop(self) -> None:
        await asyncio.gather(*(server.stop(grace=0) for server in self.servers))


def pick_faults(plan: FaultPlan, config: RunConfig) -> tuple[list[int], int]:
    """(the replicas to kill, the one to cut off): neither stragglers nor each other, spread over the fleet."""
    slow = set(stragglers(config))
    healthy = [i for i in range(plan.replicas) if i not in slow]
    kills = round(plan.kill_fraction * plan.replicas)
    if kills + 1 > len(healthy):
        raise ValueError(
            f"{plan.replicas} replicas cannot lose {kills} and cut off one besides {len(slow)} stragglers"
        )
    stride = len(healthy) / (kills + 1)
    chosen = [healthy[int(k * stride)] for k in range(kills + 1)]
    return chosen[1:], chosen[0]


async def faulty_step(plan: FaultPlan) -> dict:
    """One generation step with the plan's faults; what it measured (see the module docstring)."""
    config = plan.config()
    fleet = SimFleet(config)
    started = time.monotonic()
    await fleet.start()
    killed, cut_off = pick_faults(plan, config)
    relay = Relay(fleet.ports[cut_off])
    await relay.start()
    addresses = [f"127.0.0.1:{relay.port if i == cut_off else port}" for i, port in enumerate(fleet.ports)]
    router = RolloutRouter(addresses, probe_interval_s=0.1, max_attempts=4)
    await router.start()
    log(f"{plan.replicas} replicas up in {time.monotonic() - started:.1f} s")

    prompts = [[1 + i % 1000, 2, 3, 4] for i in range(plan.replicas * plan.prompts_per_replica)]
    expected = len(prompts) * plan.n
    seen: Counter[tuple[int, int]] = Counter()
    at_fault: dict = {}
    kills: list[asyncio.Task] = []
    restored = asyncio.Event()

    def strike() -> None:
        """The faults, all at one instant: what the victims had in flight is read before anything moves."""
        at_fault.update(
            delivered=len(seen),
            requests=sum(router.replicas[i].outstanding for i in killed),
            engine_rows=sum(fleet.rows_in_flight(i) for i in killed),
            cut_off_requests=router.replicas[cut_off].outstanding,
        )
        kills.extend(asyncio.create_task(fleet.kill(i)) for i in killed)
        relay.drop()

        def restore() -> None:
            relay.restore()
            at_fault["drop_real_s"] = time.monotonic() - at_fault["time"]
            restored.set()

        at_fault["time"] = time.monotonic()
        asyncio.get_running_loop().call_later(plan.drop_s * plan.time_scale, restore)

    began = time.monotonic()
    async for sample in router.generate_stream(
        prompts, SamplingSpec(n=plan.n, max_tokens=plan.max_tokens), chunk_prompts=plan.chunk_prompts
    ):
        seen[(sample.prompt_index, sample.sample_index)] += 1
        if not at_fault and len(seen) >= plan.fault_at * expected:
            strike()
    step_s = time.monotonic() - began
    unfinished_at_stop = sum(await asyncio.gather(*kills))
    await restored.wait()
    errors = Counter(router.replicas[i].last_error.split(":")[0] for i in killed)
    out_after_step = sorted(i for i, replica in enumerate(router.replicas) if not replica.healthy)

    restarted = time.monotonic()
    await asyncio.gather(*(fleet.restart(i) for i in killed))
    while len(router.healthy()) < plan.replicas:  # the prober's 0.1 s ticks bring them back
        if time.monotonic() - restarted > 60:
            break
        await asyncio.sleep(0.05)
    readmitted_s = time.monotonic() - restarted
    healthy_after = len(router.healthy())
    stats = router.stats
    await router.close()
    await relay.close()
    await fleet.stop()

    delivered_unique = len(seen)
    return {
        "replicas": plan.replicas,
        "killed": len(killed),
        "stragglers": len(stragglers(config)),
        "cut_off": 1,
        "drop_simulated_s": plan.drop_s,
        "drop_real_s": at_fault.get("drop_real_s"),
        "time_scale": plan.time_scale,
        "samples_requested": expected,
        "samples_delivered": sum(seen.values()),
        "samples_delivered_unique": delivered_unique,
        "samples_lost": expected - delivered_unique,
        "samples_duplicated": sum(seen.values()) - delivered_unique,
        "delivered_at_fault": at_fault["delivered"],
        "fault_real_s": at_fault["time"] - began,
        "killed_requests_in_flight": at_fault["requests"],
        "killed_engine_rows_in_flight": at_fault["engine_rows"],
        "killed_engine_rows_unfinished_at_stop": unfinished_at_stop,
        "cut_off_requests_in_flight": at_fault["cut_off_requests"],
        "router": stats.as_metrics(),
        "killed_errors": dict(errors),
        "out_after_step_are_the_killed": out_after_step == sorted(killed),
        "relay_bytes_while_dropped": relay.moved_while_dropped,
        "step_real_s": step_s,
        "step_simulated_s": step_s / plan.time_scale,
        "readmitted_real_s": readmitted_s,
        "healthy_after_restart": healthy_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = FaultPlan()
    parser.add_argument("--replicas", type=int, default=defaults.replicas)
    parser.add_argument("--prompts-per-replica", type=int, default=defaults.prompts_per_replica)
    parser.add_argument("--n", type=int, default=defaults.n)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    plan = FaultPlan(
        replicas=args.replicas,
        prompts_per_replica=args.prompts_per_replica,
        n=args.n,
        max_tokens=args.max_tokens,
        time_scale=args.time_scale,
    )
    cpu = time.process_time()
    result = asyncio.run(faulty_step(plan))
    result.update(
        process_cpu_s=time.process_time() - cpu,
        load_average=os.getloadavg()[0],
        cpus=os.cpu_count(),
        host=platform.node(),
        plan=dataclasses.asdict(plan),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    log(json.dumps({k: v for k, v in result.items() if k != "plan"}))


if __name__ == "__main__":
    main()
