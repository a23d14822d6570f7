"""Unknown config keys (rlfabric.core.config.unknown_keys, verl_keys): VeRL's keys get their rlfabric name, others
a did-you-mean; the VeRL and TRL tables name keys that exist, and docs/coming-from-verl-trl.md shows them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfabric.core.config import ConfigError, config_reference, load_config
from rlfabric.core.config.verl_keys import TRL_GRPO_KEYS, VERL_KEYS, key_table_markdown
from rlfabric.core.roles import ROLES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "coming-from-verl-trl.md"


@pytest.mark.parametrize("override, message", [
    ("trainer.total_stpes=3", "trainer.total_stpes: unknown key; did you mean trainer.total_steps?"),
    ("rolout.n=3", "rolout: unknown key; did you mean rollout?"),
    ("trainer.lr=1e-6", "trainer.lr: unknown key; did you mean actor.lr or critic.lr?"),
    ("rollout.multi_turn.max_turn=2", "rollout.multi_turn.max_turn: unknown key; did you mean "
                                      "rollout.multi_turn.max_turns?"),
    ("resource_pools.gpu.gpuss=1", "resource_pools.gpu.gpuss: unknown key; did you mean resource_pools.gpu.gpus?"),
    ("zzz=1", "zzz: unknown key"),
    ("trainer.total_epochs=3", "trainer.total_epochs: VeRL's key; use trainer.total_steps (rlfabric counts steps"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.lr: VeRL's key; use actor.lr"),
    ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name: VeRL's key; use rollout.engine"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=true",
     "actor_rollout_ref: VeRL's section; rlfabric splits it into model, actor, reference and rollout"),
    ("data.prompt_key=question", "data.prompt_key: VeRL's key; no equivalent: prompts are the `prompt` column"),
])
def test_an_unknown_key_gets_a_hint(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[override])
    assert str(error.value).startswith(f"invalid config: {message}"), str(error.value)


def test_a_verl_section_gets_a_line_per_key_it_holds(tmp_path):
    config = tmp_path / "verl.yaml"
    config.write_text("actor_rollout_ref:\n  model: {path: /m}\n  actor: {optim: {lr: 1.0e-6}}\n"
                      "critic: {optim: {lr: 1.0e-5}}\n")
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert str(error.value) == ("invalid config: critic.optim.lr: VeRL's key; use critic.lr; "
                                "actor_rollout_ref.model.path: VeRL's key; use model.path; "
                                "actor_rollout_ref.actor.optim.lr: VeRL's key; use actor.lr")


def _exists(key: str, known: set[str]) -> bool:
    """key is an rlfabric key (<role> stands for any role)."""
    return any(key.replace("<role>", role) in known for role in ROLES)


def test_every_rlfabric_key_the_tables_name_exists():
    known = {key for key, _, _ in config_reference()}
    missing = [row.ours for row in (*VERL_KEYS, *TRL_GRPO_KEYS) if row.ours and not _exists(row.ours, known)]
    assert not missing
    assert all(row.ours or row.note for row in (*VERL_KEYS, *TRL_GRPO_KEYS))  # a row without a key says why
    assert not [row.theirs for row in VERL_KEYS if _exists(row.theirs, known)]  # VeRL's that are ours too: no row


def test_the_page_shows_the_tables_of_today():
    page = PAGE.read_text()
    for rows, name in ((VERL_KEYS, "VeRL"), (TRL_GRPO_KEYS, "TRL GRPOConfig")):
        table = key_table_markdown(rows, name)
        assert table in page, f"docs/coming-from-verl-trl.md: paste this {name} table:\n{table}"
