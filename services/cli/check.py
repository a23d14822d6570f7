"""`rlfabric check CONFIG [key=value ...]`: every check a run's start makes (rlfabric.launch.preflight), with no
service started, and the resolved config written; `rlfabric up --dry-run` and `train --dry-run` run it too."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rlfabric.cli.args import _split_config_and_overrides
from rlfabric.core.config import RunConfig, dump_config, load_run_config


def cmd_check(args) -> int:
    """0 when a run could start; 1, with one line per problem on stderr, when not (2: the config does not load)."""
    config_path, overrides = _split_config_and_overrides(args)
    config = load_run_config(config_path, overrides)  # a ConfigError: one line, exit 2 (rlfabric.cli.main)
    out = args.out or Path("runs") / f"{config.name}-resolved.yaml"
    return report_checks(config, resources=args.launcher == "local", out=out)  # ray: the cluster's resources


def report_checks(config: RunConfig, resources: bool, out: Path | None) -> int:
    """Runs the checks, prints what passed (stdout) and each problem (stderr, one line each), writes the
    resolved config to `out` (if given); the exit code."""
    from rlfabric.launch.preflight import STAGE_NAMES, check_run

    started = time.monotonic()
    report = check_run(config, [stage for stage in STAGE_NAMES if resources or stage != "resources"])
    for line in report.passed:
        print(f"ok       {line}")
    for line in report.skipped:
        print(f"skipped  {line}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        dump_config(config, out)
        print(f"rlfabric check: resolved config in {out}")
    verdict = f"{len(report.problems)} problem(s)" if report.problems else "a run can start"
    print(f"rlfabric check: {verdict} ({time.monotonic() - started:.1f} s)", flush=True)
    for problem in report.problems:
        print(f"rlfabric check: {problem}", file=sys.stderr)
    return 1 if report.problems else 0
