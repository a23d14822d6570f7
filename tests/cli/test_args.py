"""The command line's parser (rlfabric.cli.args): options and dotted overrides in any order."""

from __future__ import annotations

import pytest

from rlfabric.cli.args import _split_config_and_overrides, parse_args


def test_cli_accepts_overrides_after_options():
    args = parse_args(["serve", "rollout", "--port", "0", "rollout.n=4", "trainer.total_steps=2"])
    assert args.port == 0 and args.overrides == ["rollout.n=4", "trainer.total_steps=2"]
    up = parse_args(["up", "rollout.n=2", "--run-dir", "x", "trainer.total_steps=2"])
    assert _split_config_and_overrides(up) == (None, ["rollout.n=2", "trainer.total_steps=2"])
    with pytest.raises(SystemExit):
        parse_args(["serve", "rollout", "--port", "0", "--bogus"])
