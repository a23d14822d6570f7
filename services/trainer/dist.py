"""The process group of one role: rank 0 serves gRPC and drives ranks 1..N-1 (data-parallel, or a
(N / T) x T mesh with <role>.tensor_parallel_size T: tensor_parallel.py).

Start-up: by default rank 0 opens a TCP store on a free port and starts N-1 worker processes,

    python -m rlfabric.trainer.dist --role actor --config-stdin   (RANK, WORLD_SIZE, MASTER_* set)

which join a gloo (CPU) or NCCL (GPU) process group through it. When RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT are already set (one pod per rank, e.g. a Kubernetes StatefulSet), nothing is started:
rank 0 runs `rlfabric serve ROLE` and every other rank runs the command above with --config run.yaml.
Either way rank 0's store listens on the rendezvous address only (127.0.0.1, or MASTER_ADDR, which
must then be an address of rank 0's machine), not on every interface as torch's own would.

Commands travel as tensors over the process group, never pickled: rank 0 sends each worker a header
(command + numeric parameters, float64 [8]), then that rank's shard of the batch as named tensors
(an int64 manifest of names, dtypes and shapes, then all their bytes in one buffer). Results come back
the same way. All ranks then run the same code (run_command), so their collectives line up.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from rlfabric.core import codec
from rlfabric.core.config import RunConfig, load_config
from rlfabric.core.host import cpu_thread_budget
from rlfabric.trainer.batch import TENSOR_NAMES, SequenceBatch
from rlfabric.trainer.roles import TRAINER_ROLES
from rlfabric.weight_sync.gloo import master_store

MAX_DIMS = 4
HEADER_LEN = 8
# Every tensor name that crosses the group, by index: the batch layout, then results and RNG states.
WIRE_NAMES = (*TENSOR_NAMES, "log_probs", "entropy", "sum_pi_squared", "values", "cpu_rng", "cuda_rng")
SPEC_LEN = 3 + MAX_DIMS  # name index, dtype, ndim, dims
MANIFEST_LEN = 1 + len(WIRE_NAMES) * SPEC_LEN
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
PARENT_PID_ENV = "RLFABRIC_PARENT_PID"


class Command(IntEnum):
    STOP = 0
    COMPUTE = 1  # log-probs (actor, reference) or values (critic) of the shard
    UPDATE = 2  # PPO epochs over the shard (actor, critic)
    GATHER_STATE = 3  # full model + optimizer state and RNG to rank 0 (params: with optimizer, trained only, on device)
    SCATTER_STATE = 4  # rank 0's loaded state to every rank
    LOAD_WEIGHTS = 5  # rank 0's named weights (from a weight sync) into every rank's model


def external_launch() -> tuple[int, int] | None:
    """(rank, world_size) from torchrun-style environment variables, or None to spawn workers."""
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(os.environ.get(name) for name in needed):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Channel:
    """Point-to-point messages between rank 0 and the others, as tensors on the group's device."""

    def __init__(self, device: torch.device):
        self.device = device  # NCCL moves only GPU tensors; gloo only CPU ones

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous().to(self.device), dst=dst)

    def _recv(self, shape, dtype: torch.dtype, src: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, src=src)
        return buffer

    def send_tensors(self, tensors: dict[str, torch.Tensor], dst: int) -> None:
        """Two messages: a manifest (count, then name/dtype/shape per tensor) and every tensor's bytes
        packed into one buffer. Each point-to-point message is a rendezvous, so fewer is faster."""
        manifest = torch.zeros(MANIFEST_LEN, dtype=torch.int64)
        manifest[0] = len(tensors)
        chunks = []
        for i, (name, value) in enumerate(tensors.items()):
            if value.dim() > MAX_DIMS:
                raise ValueError(f"{name}: {value.dim()} dims, more than the channel's {MAX_DIMS}")
            dims = list(value.shape) + [0] * (MAX_DIMS - value.dim())
            spec = [WIRE_NAMES.index(name), codec.wire_dtype(value.dtype), value.dim(), *dims]
            manifest[1 + i * SPEC_LEN : 1 + (i + 1) * SPEC_LEN] = torch.tensor(spec)
            raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
            chunks.append(torch.nn.functional.pad(raw, (0, _aligned(raw.numel()) - raw.numel())))
        self._send(manifest, dst)
        if chunks and sum(c.numel() for c in chunks):
            self._send(torch.cat([c.to(self.device) for c in chunks]), dst)

    def recv_tensors(self, src: int) -> dict[str, torch.Tensor]:
        manifest = self._recv((MANIFEST_LEN,), torch.int64, src).tolist()
        layout, offset = [], 0
        for i in range(manifest[0]):
            name_index, wire, ndim, *dims = manifest[1 + i * SPEC_LEN : 1 + (i + 1) * SPEC_LEN]
            dtype, shape = codec.torch_dtype(wire), dims[:ndim]
            num_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            layout.append((WIRE_NAMES[name_index], dtype, shape, offset, num_bytes))
            offset += _aligned(num_bytes)
        data = self._recv((offset,), torch.uint8, src) if offset else torch.empty(0, dtype=torch.uint8)
        return {name: data[start : start + size].view(dtype).reshape(shape)
                for name, dtype, shape, start, size in layout}

    def send_command(self, dst: int, command: Command, params: list[float], tensors: dict[str, torch.Tensor]):
        header = [float(command), *params] + [0.0] * (HEADER_LEN - 1 - len(params))
        self._send(torch.tensor(header, dtype=torch.float64), dst)
        self.send_tensors(tensors, dst)

    def recv_command(self) -> tuple[Command, list[float], dict[str, torch.Tensor]]:
        header = self._recv((HEADER_LEN,), torch.float64, src=0).tolist()
        return Command(int(header[0])), header[1:], self.recv_tensors(src=0)


def _aligned(num_bytes: int) -> int:
    """Tensors start at multiples of 8 bytes inside a packed buffer, so every dtype can view its slice."""
    return (num_bytes + 7) // 8 * 8


def run_command(worker, channel: Channel, command: Command, params: list[float], shard: SequenceBatch, state=None):
    """What every rank does for one command; returns rank 0's result (None elsewhere)."""
    rank, world_size = worker.rank, worker.world_size
    if command == Command.COMPUTE:
        outputs = worker.compute(shard, temperature=params[0], with_entropy=bool(params[1]), base_model=bool(params[2]),
                                 with_sum_pi_squared=bool(params[3]))
        if rank != 0:  # one rank per tensor-parallel group reports: its peers computed the same rows
            if rank in worker.result_ranks:
                channel.send_tensors(outputs, dst=0)
            return None
        parts = [outputs] + [{k: v.cpu() for k, v in channel.recv_tensors(src).items()} for src in worker.result_ranks[1:]]
        return {name: torch.cat([part[name] for part in parts]) for name in outputs}
    if command == Command.UPDATE:
        return worker.update(shard)
    if command == Command.GATHER_STATE:
        model_state, optimizer_state = worker.full_state(with_optimizer=bool(params[0]), trained_only=bool(params[1]),
                                                         on_device=len(params) > 2 and bool(params[2]))
        if rank != 0:
            channel.send_tensors(worker.rng_state(), dst=0)
            return None
        rng = [worker.rng_state()] + [{k: v.cpu() for k, v in channel.recv_tensors(src).items()}
                                      for src in range(1, world_size)]
        return model_state, optimizer_state, rng
    if command == Command.SCATTER_STATE:
        # params: [updates, optimizer_steps, restore_rng]
        model_state, optimizer_state, rng = state if rank == 0 else ({}, {}, None)
        worker.load_full_state(model_state, optimizer_state, progress=(int(params[0]), int(params[1])))
        if not params[2]:  # the checkpoint's RNG states do not fit this world size
            return None
        if rank == 0:
            for dst in range(1, world_size):
                channel.send_tensors(rng[dst], dst)
            worker.set_rng_state(rng[0])
        else:
            worker.set_rng_state({k: v.cpu() for k, v in channel.recv_tensors(src=0).items()})
        return None
    if command == Command.LOAD_WEIGHTS:
        worker.load_weights(state if rank == 0 else {})
        return None
    raise ValueError(f"unknown command {command}")


def serve_commands(worker, channel: Channel) -> None:
    """The loop of ranks 1..N-1: receive a command and its shard, run it, until STOP."""
    while True:
        command, params, tensors = channel.recv_command()
        if command == Command.STOP:
            return
        shard = SequenceBatch({k: v.cpu() for k, v in tensors.items()}) if tensors else None
        run_command(worker, channel, command, params, shard)


def _exit_when_parent_dies(parent_pid: int) -> None:
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)  # rank 0 is gone: nobody will ever send STOP
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_worker(role: str, config: RunConfig, rank: int, world_size: int, store=None, on_ready=None) -> None:
    """Joins the group as `rank`, loads the model (then calls on_ready), and serves rank 0's commands until STOP."""
    from rlfabric.trainer.models import rank_device
    from rlfabric.trainer.worker import RankWorker

    device = rank_device(rank)
    if device.type == "cpu":
        torch.set_num_threads(max(1, cpu_thread_budget() // world_size))
    init_group(device, rank, world_size, store)
    try:
        worker = RankWorker(role, config, rank, world_size, device)
        if on_ready is not None:
            on_ready()
        serve_commands(worker, Channel(device))
    finally:
        dist.destroy_process_group()


def serve_rank(role: str, config: RunConfig, probe_address: str, rank: int, world_size: int) -> None:
    """`rlfabric serve ROLE` as rank >= 1 in a pod of its own (a StatefulSet with one pod per rank: RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): the rank's command loop, driven by rank 0 over the group,
    and at probe_address a health-only gRPC server for the pod's probes: "liveness" SERVING from the start,
    "readiness" once the rank has joined its group and loaded the model. The role's RPCs go to rank 0."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    probes = health.HealthServicer()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(probes, server)
    if server.add_insecure_port(probe_address) == 0:
        raise OSError(f"cannot bind the probe port {probe_address}")
    server.start()
    probes.set("liveness", serving)
    for service in ("readiness", ""):
        probes.set(service, not_serving)

    def ready() -> None:
        for service in ("readiness", ""):
            probes.set(service, serving)

    try:
        # A client of rank 0's store, as the ranks rank 0 starts itself use (rank 0 holds it, not env://'s).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=COLLECTIVE_TIMEOUT)
        run_worker(role, config, rank, world_size, store=store, on_ready=ready)
    finally:
        server.stop(0)


def init_group(device: torch.device, rank: int, world_size: int, store=None) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend_for(device), rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                            **kwargs)


class WorkerGroup:
    """Rank 0's side of the group: starts ranks 1..N-1 and sends them commands. No-op for one rank."""

    def __init__(self, role: str, config: RunConfig, world_size: int, device: torch.device):
        self.role, self.config, self.world_size, self.device = role, config, world_size, device
        self.channel = Channel(device)
        self.processes: list = []

    def start(self) -> None:
        """Blocks until every rank has joined the process group."""
        if self.world_size == 1:
            return
        launch = external_launch()
        if launch is not None:
            if launch != (0, self.world_size):
                raise ValueError(f"{self.role}: the service is rank 0 of world_size {self.world_size}, but the "
                                 f"environment says RANK={launch[0]}, WORLD_SIZE={launch[1]}")
            self._store = master_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world_size,
                                       COLLECTIVE_TIMEOUT)
            init_group(self.device, 0, self.world_size, self._store)
            return
        # A fresh interpreter per rank (not multiprocessing): nothing of the parent's __main__ is re-run,
        # and a spawned rank is started exactly like a rank of a cluster, through main() below.
        store = master_store("127.0.0.1", 0, self.world_size, COLLECTIVE_TIMEOUT)
        config_json = self.config.model_dump_json()
        for rank in range(1, self.world_size):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(self.world_size), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(store.port), PARENT_PID_ENV: str(os.getpid())}
            command = [sys.executable, "-m", "rlfabric.trainer.dist", "--role", self.role, "--config-stdin"]
            process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, text=True)
            process.stdin.write(config_json)
            process.stdin.close()
            self.processes.append(process)
        self._store = store  # the store must outlive the group
        self._join(store)

    def _join(self, store) -> None:
        """init_process_group, failing fast when a started rank dies before it joins."""
        failure: list[BaseException] = []

        def join():
            try:
                init_group(self.device, 0, self.world_size, store)
            except BaseException as error:  # handed to the waiting thread
                failure.append(error)

        thread = threading.Thread(target=join, name=f"{self.role}-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
            dead = self.dead_ranks()
            if dead and thread.is_alive():
                raise RuntimeError(f"{self.role}: rank(s) {', '.join(dead)} exited before joining the group")
        if failure:
            raise failure[0]

    def send(self, command: Command, params: list[float], shards: list[SequenceBatch | None]) -> None:
        """Sends ranks 1..N-1 the command and their shards (shards[0] is rank 0's own)."""
        for rank in range(1, self.world_size):
            shard = shards[rank]
            self.channel.send_command(rank, command, params, shard.tensors if shard is not None else {})

    def dead_ranks(self) -> list[str]:
        return [f"{rank} (exit code {p.returncode})" for rank, p in enumerate(self.processes, start=1)
                if p.poll() is not None]

    def stop(self, timeout_s: float = 30.0) -> None:
        """STOP to every live rank, then waits for the processes it started (killing stragglers)."""
        formed = self.world_size > 1 and dist.is_initialized()
        if formed:
            if not self.dead_ranks():
                self.send(Command.STOP, [], [None] * self.world_size)
            dist.destroy_process_group()
        for process in self.processes:
            if not formed:  # a failed start: the ranks wait for a group that will never form
                process.kill()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main() -> None:
    """Ranks 1..N-1 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); rank 0 runs `rlfabric serve ROLE`."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--role", required=True, choices=TRAINER_ROLES)
    parser.add_argument("--config", help="run config YAML (default: the built-in quickstart)")
    parser.add_argument("--config-stdin", action="store_true", help="read the resolved config as JSON from stdin "
                        "(how rank 0 starts its ranks)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for `rlfabric serve`")
    args = parser.parse_args()
    launch = external_launch()
    if launch is None or launch[0] == 0:
        raise SystemExit("set RANK (>= 1), WORLD_SIZE, MASTER_ADDR and MASTER_PORT; rank 0 runs `rlfabric serve`")
    from rlfabric.core.logs import setup_logging

    if args.config_stdin:
        config = RunConfig.model_validate_json(sys.stdin.read())
    else:
        config = load_config(args.config, args.overrides)
    setup_logging(f"{args.role}-rank{launch[0]}", "", config.server.log_level)
    store = None
    if os.environ.get(PARENT_PID_ENV):  # started by rank 0, which opened the store
        _exit_when_parent_dies(int(os.environ[PARENT_PID_ENV]))
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launch[1],
                              is_master=False, timeout=COLLECTIVE_TIMEOUT)
    run_worker(args.role, config, rank=launch[0], world_size=launch[1], store=store)


if __name__ == "__main__":
    main()
