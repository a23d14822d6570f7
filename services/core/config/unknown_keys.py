"""What a config error says about a key the config does not have: VeRL's name for one of ours
(rlfabric.core.config.verl_keys), else the nearest keys by spelling.

    describe_unknown_key(("trainer", "total_stpes"), 3)
    # ["trainer.total_stpes: unknown key; did you mean trainer.total_steps?"]
    describe_unknown_key(("actor_rollout_ref",), {"actor": {"optim": {"lr": 1e-6}}})
    # ["actor_rollout_ref.actor.optim.lr: VeRL's key; use actor.lr"]
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from functools import cache
from typing import Any

from rlfabric.core.config.reference import config_reference
from rlfabric.core.config.verl_keys import VERL_SECTIONS, verl_hint

_NAME = "<name>"  # a key of a dict section (resource_pools.<name>.gpus) in config_reference


@cache
def _known_keys() -> tuple[str, ...]:
    """Every dotted key of RunConfig, leaves and sections, with <name> for a dict section's keys."""
    keys = set()
    for key, _, _ in config_reference():
        parts = key.split(".")
        keys.update(".".join(parts[: depth + 1]) for depth in range(len(parts)))
    return tuple(sorted(keys))


def _leaves(key: str, value: Any) -> list[str]:
    """The dotted keys a value sets under key: itself, or with a mapping, each key inside."""
    if isinstance(value, dict) and value:
        return [leaf for name, item in value.items() for leaf in _leaves(f"{key}.{name}", item)]
    return [key]


def did_you_mean(key: str) -> list[str]:
    """The known keys nearest to `key`: its section's keys spelled like its last part, else the keys of other
    sections with that very name (trainer.lr -> actor.lr), else any key spelled like the whole (difflib)."""
    known = _known_keys()
    parent, _, last = key.rpartition(".")
    parts = parent.split(".") if parent else []
    if len(parts) >= 2 and f"{parts[0]}.{_NAME}" in known:  # resource_pools.gpu_pool.gpuss
        parent = ".".join([parts[0], _NAME, *parts[2:]])
    siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(last, siblings, n=2, cutoff=0.7)
    if close:
        return [f"{key.rpartition('.')[0]}.{name}" if parent else name for name in close]
    same_name = [k for k in known if k.rpartition(".")[2] == last]
    if same_name:
        return same_name[:3]
    return difflib.get_close_matches(key, [k for k in known if not key.startswith(k + ".")], n=2, cutoff=0.8)


def describe_unknown_key(loc: Sequence[Any], value: Any) -> list[str]:
    """What to say about the unknown key at `loc` (a mapping under it counts as each key inside): VeRL's hint
    for each of those keys that is one of VeRL's, and one line for the rest: VeRL's hint for their section,
    else a did-you-mean, else "unknown key"."""
    key = ".".join(str(part) for part in loc)
    hints = {leaf: verl_hint(leaf) for leaf in _leaves(key, value)}
    lines = [f"{leaf}: {hint}" for leaf, hint in hints.items() if hint is not None]
    if None in hints.values():
        section_hint = VERL_SECTIONS.get(key.split(".")[0])
        close = did_you_mean(key)
        lines.append(f"{key}: {section_hint}" if section_hint else
                     f"{key}: unknown key" + (f"; did you mean {' or '.join(close)}?" if close else ""))
    return lines
