"""`rlfabric status`, `rlfabric stop` and `rlfabric health`: asking a running mesh."""

from __future__ import annotations

import asyncio
import json
import sys

from rlfabric.core.config import load_config


def _coordinator_target(args, config=None):
    """(address, ChannelOptions) of the coordinator named by --run-dir or --coordinator (with --token-file
    or the token and TLS settings of the mesh's config); (None, message) when neither was given."""
    from dataclasses import replace

    from rlfabric.core.client import ChannelOptions
    from rlfabric.core.config import ServerConfig, read_auth_token

    run_dir = getattr(args, "run_dir", None)
    if args.coordinator is None and run_dir is not None:
        address = _coordinator_of_run(run_dir)
        if address is None or not (run_dir / "config.yaml").is_file():
            return None, (f"{run_dir} is not the folder of a running mesh: it has no endpoints.json with the "
                          "coordinator's address (`rlfabric up` and `rlfabric train` write it once the mesh is up)")
        # The run's own TLS and token settings, so this works on a mesh that runs mTLS.
        return address, ChannelOptions.from_config(load_config(run_dir / "config.yaml"))
    if args.coordinator is None:
        return None, "give --coordinator HOST:PORT or --run-dir"
    options = ChannelOptions.from_config(config) if config is not None else ChannelOptions()
    if args.token_file:
        options = replace(options, auth_token=read_auth_token(ServerConfig(auth_token_file=args.token_file)))
    return args.coordinator, options

def _coordinator_of_run(run_dir) -> str | None:
    """The coordinator's address in RUN_DIR/endpoints.json; None when the file is missing or holds none."""
    try:
        return json.loads((run_dir / "endpoints.json").read_text())["coordinator"][0]["grpc"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None

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
    import grpc
    from grpc_health.v1 import health_pb2

    from rlfabric.core.client import check_health, open_channel

    async def check() -> int:
        async with open_channel(args.address) as channel:
            return await check_health(channel, args.service, timeout_s=args.timeout)

    try:
        status = asyncio.run(check())
    except Exception as error:  # any failure is "not healthy" for a probe
        details = error.details() if isinstance(error, grpc.RpcError) else str(error)  # not the repr's 5 lines
        print(f"{args.address}: {details}", file=sys.stderr)
        return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1
