"""`rlfabric serve ROLE`: one service, as a container runs it."""

from __future__ import annotations

from rlfabric.agents.servicer import AGENT_HOST
from rlfabric.core.config import load_config
from rlfabric.core.logs import setup_logging


def cmd_serve(args) -> int:
    from rlfabric.core.config import read_env_token
    from rlfabric.core.roles import ROLE_TABLE, Kind
    from rlfabric.core.server import ServerOptions
    from rlfabric.serve import build_service, run_service

    config = load_config(args.config, args.overrides)
    if args.host:
        config.server.host = args.host  # what the service binds, for everything derived from it
    setup_logging(args.role, args.run_id, config.server.log_level)
    if args.role == AGENT_HOST:
        return _serve_agent_host(args, config)
    if args.check:  # the imports and the service, not the mounts (token, TLS files) of a pod
        service = build_service(args.role, config, replica=args.replica)
        print(f"rlfabric serve {args.role}: {type(service.engine).__name__} builds; ready to serve")
        return 0
    # An environment never holds the mesh's token.
    token = read_env_token(config) if ROLE_TABLE[args.role].kind is Kind.ENVIRONMENT else None
    options = ServerOptions.from_config(
        config.server, token, host=args.host, port=args.port, metrics_port=args.metrics_port,
        health_port=args.health_port)
    if args.replicas < 1 or args.replica < 0 or args.replica_stride < 1:
        raise SystemExit("rlfabric serve: --replicas and --replica-stride must be >= 1 and --replica >= 0")
    if args.replicas > 1 and not ROLE_TABLE[args.role].replicated:
        raise SystemExit(f"rlfabric serve {args.role}: --replicas is for the rollout and judge roles")
    if args.replicas > 1 and args.port_file and "{replica}" not in args.port_file:
        raise SystemExit("rlfabric serve: with --replicas, --port-file needs {replica} in its path")
    run_service(args.role, config, options, port_file=args.port_file,
                replicas=range(args.replica, args.replica + args.replicas * args.replica_stride, args.replica_stride))
    return 0


def _serve_agent_host(args, config) -> int:
    """`rlfabric serve agent`: the config's agent behind AgentService (rlfabric.agents.servicer)."""
    from rlfabric.agents.servicer import build_service, serve_agent_host
    from rlfabric.core.server import ServerOptions

    if args.check:
        build_service(config)
        print(f"rlfabric serve {AGENT_HOST}: {config.agent.runner} runner builds; ready to serve")
        return 0
    options = ServerOptions.from_config(config.server, "", host=args.host, port=args.port,
                                        metrics_port=args.metrics_port, health_port=args.health_port)
    serve_agent_host(config, options, args.port_file)
    return 0
