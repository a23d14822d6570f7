"""Weight sync throughput: 1 GiB of actor weights to 1 and 2 hf rollout replicas over gloo and grpc on
loopback, next to a raw TCP loopback transfer of the same bytes (socket sendall / recv_into between
processes) measured right before each configuration, so both see the same machine load. The grpc
rows also carry bare gRPC streams of the same bytes in the transport's layout (CHUNK_BYTES
messages over STREAMS_PER_RECEIVER connections per receiver; no parsing, copying or checking):
the library's own share. Writes bench/results/weight_sync.json.

    python -m bench.weight_sync_bench [--gib 1.0] [--repeats 3]

Every service is its own process (`rlfabric serve`), as in a deployment; the coordinator's
WeightSyncPlane drives the syncs. Figures per (transport, receivers):
- transfer GB/s: bytes per receiver / the transfer time. gloo: the actor's BroadcastWeights time
  (the bytes on the wire; each receiver checks and switches after it). grpc: BroadcastWeights waits
  for every PushWeights answer, which comes after the receiver's switch, so the transfer is that time
  less the smallest paused_seconds a receiver reports (an upper bound of the time until every
  receiver had every byte in and checked); push_gb_s keeps the switch in.
- sync seconds: the whole plane.sync (gather + pack + CRC, transfer, each receiver's CRC and switch);
- paused seconds: how long each replica held generation for the switch.
Targets (issue 7): gloo >= 70% of raw TCP, grpc >= 40%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

RESULTS = Path(__file__).parent / "results" / "weight_sync.json"
TCP_REPEATS = 2


# -- baselines: raw TCP loopback, and a bare gRPC stream ------------------------------------------------

def _tcp_receiver(port: int, size: int) -> None:
    """Child process: connect, receive `size` bytes into one (pre-touched) buffer, twice."""
    buffer = memoryview(bytearray(b"\x01") * size)  # mapped before the clock starts, as the syncs' buffers are
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(TCP_REPEATS):
            received = 0
            while received < size:
                count = sock.recv_into(buffer[received:])
                if count == 0:
                    raise SystemExit("sender closed early")
                received += count
            sock.sendall(b"k")  # done: the sender stops its clock on this byte


def raw_tcp_gb_s(size: int, receivers: int) -> float:
    """GB/s per receiver of `size` bytes sent to each receiver at once (one thread per socket), best of
    TCP_REPEATS."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (size >> 20))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        children = [subprocess.Popen([sys.executable, "-m", "bench.weight_sync_bench", "--tcp-receiver", str(port),
                                      str(size)]) for _ in range(receivers)]
        connections = [server.accept()[0] for _ in range(receivers)]

        def send(connection):
            connection.sendall(payload)
            connection.recv(1)

        best = float("inf")
        for _ in range(TCP_REPEATS):
            started = time.perf_counter()
            threads = [threading.Thread(target=send, args=(c,)) for c in connections]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            best = min(best, time.perf_counter() - started)
        for connection in connections:
            connection.close()
        for child in children:
            child.wait(60)
    return size / best / 1e9


def _grpc_receiver() -> None:
    """Child process: a bare gRPC server that counts the bytes of a client stream (no parsing)."""
    from grpc import aio

    async def serve() -> None:
        async def count(chunks, context):
            total = 0
            async for chunk in chunks:
                total += len(chunk)
            return str(total).encode()

        handler = grpc.method_handlers_generic_handler("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(count)})
        server = aio.server(options=[("grpc.max_receive_message_length", 256 << 20)])
        server.add_generic_rpc_handlers((handler,))
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def bare_grpc_gb_s(size: int, receivers: int) -> float:
    """GB/s per receiver of the same bytes as bare gRPC messages to each receiver at once, in the grpc
    transport's layout (CHUNK_BYTES messages over STREAMS_PER_RECEIVER connections per receiver), best
    of 2: what gRPC itself costs before any parsing, copying or checking."""
    from grpc import aio

    from rlfabric.weight_sync.grpc_stream import CHUNK_BYTES, STREAMS_PER_RECEIVER

    children = [subprocess.Popen([sys.executable, "-m", "bench.weight_sync_bench", "--grpc-receiver"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(receivers)]
    ports = [int(child.stdout.readline()) for child in children]
    chunk = os.urandom(1 << 20) * (CHUNK_BYTES >> 20)
    per_stream = size // len(chunk) // STREAMS_PER_RECEIVER

    async def push_all() -> float:
        options = [("grpc.max_send_message_length", 256 << 20), ("grpc.use_local_subchannel_pool", 1)]
        channels = [aio.insecure_channel(f"127.0.0.1:{p}", options=options)
                    for p in ports for _ in range(STREAMS_PER_RECEIVER)]
        calls = [c.stream_unary("/bench.Sink/Push") for c in channels]
        best = float("inf")
        for _ in range(TCP_REPEATS):
            started = time.perf_counter()
            await asyncio.gather(*(call(iter([chunk] * per_stream)) for call in calls))
            best = min(best, time.perf_counter() - started)
        for channel in channels:
            await channel.close()
        return best

    try:
        seconds = asyncio.run(push_all())
    finally:
        for child in children:
            child.kill()
            child.wait()
    return per_stream * STREAMS_PER_RECEIVER * len(chunk) / seconds / 1e9


# -- the services ------------------------------------------------------------------------------------

def serve(role: str, config_path: Path, workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    port_file = workdir / f"{name}.ports.json"
    log = (workdir / f"{name}.log").open("ab")
    process = subprocess.Popen([sys.executable, "-m", "rlfabric", "serve", role, "--config", str(config_path),
                                "--port", "0", "--metrics-port", "0", "--port-file", str(port_file)],
                               stdout=log, stderr=log)
    while not port_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited; see {workdir / f'{name}.log'}")
        time.sleep(0.1)
    return process, f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"


def transfer_seconds(report, transport: str) -> float:
    """The transfer of one sync (see the module doc): grpc's BroadcastWeights less the switch."""
    if transport != "grpc":
        return report.broadcast_seconds
    return report.broadcast_seconds - min(report.paused_seconds.values(), default=0.0)


async def measure_syncs(actor_address: str, rollouts: dict[str, str], config, repeats: int, size: int) -> list[dict]:
    from rlfabric.actor.client import ActorClient
    from rlfabric.coordinator.weight_sync import WeightSyncPlane
    from rlfabric.core.client import wait_until_serving

    for address in [actor_address, *rollouts.values()]:
        await wait_until_serving(address, timeout_s=600)
    rows = []
    version = 0
    async with ActorClient(actor_address) as actor:
        for transport in ("gloo", "grpc"):
            for count in (1, 2):
                # the baselines right before (and raw TCP again right after) this configuration, so they see the same machine load
                tcp = await asyncio.to_thread(raw_tcp_gb_s, size, count)
                bare = await asyncio.to_thread(bare_grpc_gb_s, size, count) if transport == "grpc" else None
                receivers = dict(list(rollouts.items())[:count])
                run_config = config.model_copy(update={"weight_sync": config.weight_sync.model_copy(
                    update={"transport": transport})})
                plane = WeightSyncPlane(actor, receivers, run_config)
                assert await plane.open() == {}
                version += 1
                await plane.sync(version)  # warm-up: first-touch of every buffer
                reports = []
                for _ in range(repeats):
                    version += 1
                    report = await plane.sync(version)
                    if not report.ok:
                        raise RuntimeError(f"sync failed: {report.failed} {report.actor_error}")
                    reports.append(report)
                await plane.close()
                # and right after: the faster of the two is the baseline (load spikes only slow a transfer)
                tcp_both = [tcp, await asyncio.to_thread(raw_tcp_gb_s, size, count)]
                tcp = max(tcp_both)
                transfers = [transfer_seconds(r, transport) for r in reports]
                best = min(range(len(reports)), key=transfers.__getitem__)
                gb_s = reports[best].num_bytes / transfers[best] / 1e9
                row = {
                    "transport": transport, "receivers": count, "bytes": reports[best].num_bytes,
                    "transfer_gb_s": round(gb_s, 3), "raw_tcp_gb_s": round(tcp, 3),
                    "raw_tcp_gb_s_before_after": [round(t, 3) for t in tcp_both], "vs_raw_tcp": round(gb_s / tcp, 3),
                    "target_vs_raw_tcp": 0.7 if transport == "gloo" else 0.4,
                    **({"push_gb_s": round(reports[best].num_bytes / reports[best].broadcast_seconds / 1e9, 3),
                        "bare_grpc_gb_s": round(bare, 3), "bare_grpc_vs_raw_tcp": round(bare / tcp, 3)} if bare else {}),
                    "transfer_seconds": [round(t, 3) for t in transfers],
                    "broadcast_seconds": [round(r.broadcast_seconds, 3) for r in reports],
                    "sync_seconds": [round(r.seconds, 3) for r in reports],
                    "paused_seconds": [{k: round(v, 4) for k, v in r.paused_seconds.items()} for r in reports],
                }
                print(f"{transport} -> {count}: {row['transfer_gb_s']} GB/s transfer = {row['vs_raw_tcp']:.2f} x raw TCP "
                      f"({row['raw_tcp_gb_s']} GB/s), sync {row['sync_seconds']} s, paused {row['paused_seconds']}"
                      + (f"; bare gRPC {row['bare_grpc_gb_s']} GB/s" if bare else ""), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="weights to sync, in GiB (float32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tcp-receiver", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-receiver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    if args.tcp_receiver:
        return _tcp_receiver(*args.tcp_receiver)
    if args.grpc_receiver:
        return _grpc_receiver()

    from rlfabric.core.config import dump_config, load_config
    from rlfabric.quickstart.tiny_model import make_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="rlfabric-weight-sync-bench-"))
    processes = []
    try:
        # 16 layers of hidden 1024 / MLP 4096 = 268 M parameters = 1.0 GiB of float32 (scaled by --gib).
        layers = max(1, round(16 * args.gib))
        model = make_tiny_model(workdir / "model", hidden_size=1024, num_layers=layers, num_heads=32,
                                intermediate_size=4096)
        config = load_config(None, [f"model.path={model}", "weight_sync.timeout_s=300", "rollout.dtype=float32"])
        config_path = workdir / "run.yaml"
        dump_config(config, config_path)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors")) >> 20 << 20
        actor, actor_address = serve("actor", config_path, workdir, "actor")
        processes.append(actor)
        rollouts = {}
        for i in range(2):
            process, rollouts[f"rollout-{i}"] = serve("rollout", config_path, workdir, f"rollout-{i}")
            processes.append(process)
        rows = asyncio.run(measure_syncs(actor_address, rollouts, config, args.repeats, size))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    import torch

    from rlfabric.weight_sync.buckets import CRC32_IMPLEMENTATION
    from rlfabric.weight_sync.grpc_stream import CHUNK_BYTES, STREAMS_PER_RECEIVER

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "weights_bytes": size, "bucket_mb": config.weight_sync.bucket_mb, "results": rows,
        "grpc_chunk_bytes": CHUNK_BYTES, "grpc_streams_per_receiver": STREAMS_PER_RECEIVER,
        "crc32": CRC32_IMPLEMENTATION,
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
    }, indent=2) + "\n")
    for row in rows:
        print(f"{row['transport']:>4} -> {row['receivers']}: {row['transfer_gb_s']} GB/s = "
              f"{row['vs_raw_tcp']:.2f} x raw TCP (target {row['target_vs_raw_tcp']})")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
