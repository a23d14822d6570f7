"""`rlfabric helm-values CONFIG [key=value ...]`: a run config as the Helm chart's values, on stdout
(rlfabric.tools.helm_values); what the chart cannot run as given goes to stderr."""

from __future__ import annotations

import sys

from rlfabric.cli.args import _split_config_and_overrides


def cmd_helm_values(args) -> int:
    from rlfabric.tools.helm_values import CHART, dump_values, helm_values

    config, overrides = _split_config_and_overrides(args)
    values, warnings = helm_values(config, overrides, args.chart or CHART, args.stage_model, args.stage_data)
    sys.stdout.write(dump_values(values))
    for warning in warnings:
        print(f"rlfabric helm-values: {warning}", file=sys.stderr)
    return 0
