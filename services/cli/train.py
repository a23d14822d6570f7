"""`rlfabric train`: a mesh, a run on it until it ends, the teardown; `--in-process` (every role in this
process) and `--coordinator` (a run on a mesh that is already up). train_run is that path as a function:
`rlfabric train` and rlfabric.train (rlfabric.api) both call it."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlfabric.cli.args import _split_config_and_overrides
from rlfabric.cli.control import _coordinator_target
from rlfabric.cli.up import _print_placement, _raise_on_sigterm, build_mesh
from rlfabric.core.config import ConfigError, RunConfig, load_config, load_run_config
from rlfabric.core.logs import setup_logging
from rlfabric.core.roles import ROLE_TABLE, Kind

if TYPE_CHECKING:
    from rlfabric.v1.coordinator_pb2 import CoordinatorServiceGetRunStatusResponse

LAUNCHERS = ("local", "ray", "in-process")


class RunRefused(RuntimeError):
    """The coordinator refused to start the run (StartRun failed): its words, status code first."""


@dataclass
class FinishedRun:
    """A run that reached its end: the coordinator's last status and the run's folder."""

    status: CoordinatorServiceGetRunStatusResponse
    run_dir: Path  # run_dir_of the config: metrics.jsonl, checkpoints/, final_model/


def cmd_train(args) -> int:
    """Brings the mesh up, runs one training run to its end and tears the mesh down. Ctrl-C (or
    SIGTERM) stops the run at the next step boundary after a checkpoint and the final-model export;
    a second Ctrl-C stops at once."""
    from rlfabric.launch.local import default_run_dir

    if args.dry_run:
        return _print_placement(args)
    _raise_on_sigterm()
    if args.in_process and (args.launcher != "local" or args.address or args.coordinator):
        raise ConfigError("--in-process runs every role in this process: --launcher, --address and --coordinator "
                          "do not apply")
    try:
        if args.coordinator:
            return _train_attached(args)
        config_path, overrides = _split_config_and_overrides(args)
        config = load_run_config(config_path, overrides)
        run_dir = args.run_dir or default_run_dir(config)
        launcher = "in-process" if args.in_process else args.launcher
        setup_logging("in-process" if args.in_process else "launcher", run_dir.name, config.server.log_level)
        return _exit_code(train_run(config, run_dir, launcher, ray_address=args.address).status)
    except RunRefused as error:
        print(f"rlfabric: the coordinator refused the run: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def train_run(config: RunConfig, run_dir: Path, launcher: str = "local", *,
              ray_address: str | None = None) -> FinishedRun:
    """One training run from start to end in run_dir, on the mesh of `launcher`: "local" (a process per
    service), "ray" (a Ray actor per service, on the cluster at ray_address) or "in-process" (every role in
    this process, rlfabric.launch.inprocess). Follows it with the progress bar (trainer.progress_bar), then
    stops the mesh and prints what the run left. RunRefused when the coordinator refuses the run.

    Ctrl-C: on a mesh, stops the run at the next step boundary with a checkpoint (a second Ctrl-C stops at
    once); in process, at once (the last checkpoint stays the resume point); then KeyboardInterrupt."""
    if launcher not in LAUNCHERS:
        raise ConfigError(f"launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if launcher == "in-process":
        return _train_in_process(config, run_dir)
    return _train_on_mesh(config, run_dir, launcher, ray_address)


def _train_on_mesh(config: RunConfig, run_dir: Path, launcher: str, ray_address: str | None) -> FinishedRun:
    from rlfabric.core.client import ChannelOptions
    from rlfabric.core.config import run_dir_of

    with build_mesh(config, run_dir, launcher, ray_address) as mesh:
        run_folder = run_dir_of(mesh.config)  # the mesh's folder, or its experiments/<trainer.experiment_name>
        address = mesh.endpoints["coordinator"][0]["grpc"]
        options = ChannelOptions.from_config(mesh.config)
        print(f"rlfabric: mesh ready; coordinator at {address}", flush=True)
        try:
            status = asyncio.run(_run_training_at(address, options, mesh.config))
        except KeyboardInterrupt:
            print("rlfabric: interrupted; stopping after the current step with a checkpoint "
                  "(Ctrl-C again to stop without one)", flush=True)
            try:
                asyncio.run(_stop_with_checkpoint(address, options))
            except KeyboardInterrupt:
                print("rlfabric: stopping the mesh without a checkpoint", flush=True)
            raise
        finally:
            _print_outputs(run_folder)
        return FinishedRun(status, run_folder)


def _train_in_process(config: RunConfig, run_dir: Path) -> FinishedRun:
    """Every role's engine, the coordinator's loop and in-process clients between them, in this process
    (rlfabric.launch.inprocess)."""
    from rlfabric.core.config import run_dir_of

    print(f"rlfabric: starting every role in this process in {run_dir}", flush=True)
    try:
        status = asyncio.run(_in_process_training(config, run_dir))
    except KeyboardInterrupt:
        print("rlfabric: interrupted; the run stopped where it was (its last checkpoint is the resume point)",
              flush=True)
        raise
    finally:
        if config.trainer.run_dir:  # set once RUN_DIR was prepared
            _print_outputs(run_dir_of(config))
    return FinishedRun(status, run_dir_of(config))


async def _in_process_training(config: RunConfig, run_dir: Path) -> CoordinatorServiceGetRunStatusResponse:
    from rlfabric.launch.inprocess import InProcessMesh

    async with InProcessMesh(config, run_dir) as mesh:
        return await _run_training(mesh.coordinator, config)


async def _start_and_watch(client, overrides: list[str], progress_bar: bool, step_lines: bool = False):
    """StartRun, then follow the run to its end (watch_run); its final status. RunRefused when the
    coordinator refuses the run."""
    from rlfabric.coordinator.watch import watch_run
    from rlfabric.core.errors import RlfabricError

    try:
        started = await client.start_run(overrides)
    except RlfabricError as error:  # over gRPC its words start with the status code; in process they do not
        raise RunRefused(str(error) if str(error).startswith(error.code.name) else f"{error.code.name}: {error}") \
            from None
    total = (await client.run_status(timeout_s=30)).total_steps
    print(f"rlfabric: run {started.run_id} started at step {started.start_step} of {total}", flush=True)
    return await watch_run(client, total, started.start_step, progress_bar=progress_bar, step_lines=step_lines)


def _exit_code(status) -> int:
    """0 for a run that completed; else 1, after saying how it ended."""
    from rlfabric.v1 import coordinator_pb2

    state = coordinator_pb2.RunState.Name(status.state)
    if status.state != coordinator_pb2.RUN_STATE_COMPLETED:
        print(f"rlfabric: the run ended {state} at step {status.step}: {status.error}", file=sys.stderr)
        return 1
    print(f"rlfabric: run {status.run_id} {state} at step {status.step}", flush=True)
    return 0


async def _run_training_at(address: str, options, config: RunConfig) -> CoordinatorServiceGetRunStatusResponse:
    from rlfabric.coordinator.client import CoordinatorClient

    async with CoordinatorClient(address, options) as client:
        return await _run_training(client, config)


async def _run_training(client, config: RunConfig) -> CoordinatorServiceGetRunStatusResponse:
    """One run through `client` (a CoordinatorInterface) from start to end; its final status."""
    from rlfabric.coordinator.tracking import read_metrics
    from rlfabric.core.config import run_dir_of

    status = await _start_and_watch(client, [], progress_bar=config.trainer.progress_bar)
    records = read_metrics(run_dir_of(config) / "metrics.jsonl")
    scores = [r["critic/score/mean"] for r in records if "critic/score/mean" in r]
    if scores:
        last = scores[-3:]
        print(f"rlfabric: critic/score/mean first step {scores[0]:.3f}, mean of the last {len(last)} "
              f"steps {sum(last) / len(last):.3f}", flush=True)
    return status


def _train_attached(args) -> int:
    """`rlfabric train --coordinator HOST:PORT [CONFIG] [key=value ...]`: waits until every service of the
    running mesh (CONFIG's cluster section and the coordinator) is ready, starts a run with the overrides,
    prints a line per step and exits 0 when the run completes, 1 when it fails or is refused. What the
    chart's run Job runs, and what a laptop runs through a port-forward."""
    if args.launcher != "local" or args.address or args.run_dir:
        raise ConfigError("--coordinator attaches to a running mesh: --launcher, --address and --run-dir do not apply")
    config_path, overrides = _split_config_and_overrides(args)
    config = load_config(config_path)
    address, options = _coordinator_target(args, config)
    try:
        return asyncio.run(_attached_run(address, options, config, overrides, args.wait_timeout))
    except KeyboardInterrupt:
        print("rlfabric: interrupted; stopping after the current step with a checkpoint", flush=True)
        asyncio.run(_stop_with_checkpoint(address, options))
        raise


async def _attached_run(address: str, options, config, overrides: list[str], wait_timeout_s: float) -> int:
    from rlfabric.coordinator.client import CoordinatorClient
    from rlfabric.core.client import wait_until_serving
    from rlfabric.core.errors import DeadlineExceeded

    services = [address, *(a for name, role in ROLE_TABLE.items() if role.kind is not Kind.COORDINATOR
                           for a in getattr(config.cluster, name))]
    print(f"rlfabric: waiting for {len(services)} services to be ready", flush=True)
    try:
        await asyncio.gather(*(wait_until_serving(a, options, timeout_s=wait_timeout_s) for a in services))
    except DeadlineExceeded as error:
        print(f"rlfabric: the mesh is not ready: {error}", file=sys.stderr)
        return 1
    async with CoordinatorClient(address, options) as client:
        interactive = sys.stderr.isatty()
        status = await _start_and_watch(client, overrides, progress_bar=interactive, step_lines=not interactive)
    return _exit_code(status)


async def _stop_with_checkpoint(address: str, options) -> None:
    from rlfabric.coordinator.client import CoordinatorClient
    from rlfabric.core.errors import RlfabricError

    async with CoordinatorClient(address, options) as client:
        try:
            await client.stop_run(timeout_s=1800)
        except RlfabricError as error:  # e.g. no run had started yet, or the save failed
            print(f"rlfabric: stopping the run: {error}", file=sys.stderr)


def _print_outputs(run_dir: Path) -> None:
    """What the run left, each path only if it exists."""
    from rlfabric.coordinator.checkpoints import latest_checkpoint

    outputs = {"metrics": run_dir / "metrics.jsonl", "curves": run_dir / "curves.png",
               "checkpoint": latest_checkpoint(run_dir), "final model": run_dir / "final_model"}
    shown = [f"{what} {path}" for what, path in outputs.items() if path is not None and path.exists()]
    if shown:
        print(f"rlfabric: {', '.join(shown)}", flush=True)
