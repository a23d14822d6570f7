"""`rlfabric train`: a mesh, a run on it until it ends, the teardown; `--in-process` (every role in this
process) and `--coordinator` (a run on a mesh that is already up)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from rlfabric.cli.args import _split_config_and_overrides
from rlfabric.cli.control import _coordinator_target
from rlfabric.cli.up import _print_placement, _raise_on_sigterm, _start_mesh
from rlfabric.core.config import ConfigError, load_config, load_run_config
from rlfabric.core.logs import setup_logging
from rlfabric.core.roles import ROLE_TABLE, Kind


def cmd_train(args) -> int:
    """Brings the mesh up, runs one training run to its end and tears the mesh down. Ctrl-C (or
    SIGTERM) stops the run at the next step boundary after a checkpoint and the final-model export;
    a second Ctrl-C stops at once."""
    from rlfabric.core.client import ChannelOptions
    from rlfabric.core.config import run_dir_of

    if args.dry_run:
        return _print_placement(args)
    _raise_on_sigterm()
    if args.in_process:
        return _train_in_process(args)
    if args.coordinator:
        return _train_attached(args)
    mesh = _start_mesh(args)
    with mesh:
        run_dir = run_dir_of(mesh.config)  # the mesh's folder, or its experiments/<trainer.experiment_name>
        address = mesh.endpoints["coordinator"][0]["grpc"]
        options = ChannelOptions.from_config(mesh.config)
        print(f"rlfabric: mesh ready; coordinator at {address}", flush=True)
        try:
            code = asyncio.run(_run_training_at(address, options, mesh.config, run_dir))
        except KeyboardInterrupt:
            print("rlfabric: interrupted; stopping after the current step with a checkpoint "
                  "(Ctrl-C again to stop without one)", flush=True)
            try:
                asyncio.run(_stop_with_checkpoint(address, options))
            except KeyboardInterrupt:
                print("rlfabric: stopping the mesh without a checkpoint", flush=True)
            code = 130
        _print_outputs(run_dir)
        return code

async def _start_and_watch(client, overrides: list[str], progress_bar: bool, step_lines: bool = False):
    """StartRun, then follow the run to its end (watch_run); its final status, or None, after saying why,
    when the coordinator refuses the run."""
    from rlfabric.coordinator.watch import watch_run
    from rlfabric.core.errors import RlfabricError

    try:
        started = await client.start_run(overrides)
    except RlfabricError as error:  # over gRPC its words start with the status code; in process they do not
        words = str(error) if str(error).startswith(error.code.name) else f"{error.code.name}: {error}"
        print(f"rlfabric: the coordinator refused the run: {words}", file=sys.stderr)
        return None
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

async def _run_training_at(address: str, options, config, run_dir: Path) -> int:
    from rlfabric.coordinator.client import CoordinatorClient

    async with CoordinatorClient(address, options) as client:
        return await _run_training(client, config, run_dir)

async def _run_training(client, config, run_dir: Path) -> int:
    """One run through `client` (a CoordinatorInterface) from start to end; its exit code."""
    from rlfabric.coordinator.tracking import read_metrics

    status = await _start_and_watch(client, [], progress_bar=config.trainer.progress_bar)
    if status is None:
        return 1
    scores = [r["critic/score/mean"] for r in read_metrics(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    if scores:
        last = scores[-3:]
        print(f"rlfabric: critic/score/mean first step {scores[0]:.3f}, mean of the last {len(last)} "
              f"steps {sum(last) / len(last):.3f}", flush=True)
    return _exit_code(status)

def _train_in_process(args) -> int:
    """`rlfabric train --in-process [CONFIG] [key=value ...]`: every role's engine, the coordinator's
    loop and in-process clients between them, in this process (rlfabric.launch.inprocess). Ctrl-C stops at
    once; the last checkpoint stays the resume point."""
    from rlfabric.core.config import run_dir_of
    from rlfabric.launch.local import default_run_dir

    if args.launcher != "local" or args.address or args.coordinator:
        raise ConfigError("--in-process runs every role in this process: --launcher, --address and --coordinator "
                          "do not apply")
    config_path, overrides = _split_config_and_overrides(args)
    config = load_run_config(config_path, overrides)
    run_dir = args.run_dir or default_run_dir(config)
    setup_logging("in-process", run_dir.name, config.server.log_level)
    print(f"rlfabric: starting every role in this process in {run_dir}", flush=True)
    try:
        code = asyncio.run(_in_process_training(config, run_dir))
    except KeyboardInterrupt:
        print("rlfabric: interrupted; the run stopped where it was (its last checkpoint is the resume point)",
              flush=True)
        code = 130
    if config.trainer.run_dir:  # set once RUN_DIR was prepared
        _print_outputs(run_dir_of(config))
    return code

async def _in_process_training(config, run_dir: Path) -> int:
    from rlfabric.core.config import run_dir_of
    from rlfabric.launch.inprocess import InProcessMesh

    async with InProcessMesh(config, run_dir) as mesh:
        return await _run_training(mesh.coordinator, config, run_dir_of(config))

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
        return 130

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
    return 1 if status is None else _exit_code(status)

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
