"""reasoning-gym's procedural datasets as rows in VeRL's schema (data.builtin_task reasoning_gym; the extra
rlfabric[reasoning-gym]).

The rows come from the library's composite dataset over data.reasoning_gym.datasets (its weights pick each
row's dataset; its sub-dataset seeds are the mix's seed + 1, + 2, ...). Training rows are the mix's entries 0 ..
size-1, validation rows the next val_size (a question already among the training rows is left out), so the two
never share an entry. A row:

    data_source   reasoning_gym/<dataset>
    prompt        [system: SYSTEM_PROMPTS[data.reasoning_gym.system_prompt]], [user: the entry's question]
    ability       reasoning
    reward_model  {style: rule, ground_truth: '{"dataset", "config", "seed", "size", "index"}'}
    extra_info    {split, index, dataset}

The ground truth names where the entry comes from, not its answer: the reward service regenerates the entry
(rlfabric.reward.reasoning_gym) because many scorers read the entry's metadata and the dataset's config. Neither
the answer nor the metadata (which often holds the solution) is in the row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlfabric.core.config import ConfigError
from rlfabric.core.config.model import ReasoningGymConfig

ABILITY = "reasoning"


def _require_library() -> None:
    try:
        import reasoning_gym  # noqa: F401
    except ModuleNotFoundError:
        raise ConfigError(
            "data.builtin_task reasoning_gym needs the reasoning_gym package: pip install "
            "'rlfabric[reasoning-gym]'"
        ) from None


def system_message(config: ReasoningGymConfig) -> str:
    """The system prompt's text: a SYSTEM_PROMPTS name, else the text as given."""
    _require_library()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(config.system_prompt, config.system_prompt)


def build_mix(config: ReasoningGymConfig):
    """The library's composite dataset over the configured datasets, of size + val_size entries; ConfigError
    naming the key for an unknown dataset or a config the library refuses."""
    _require_library()
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS

    unknown = sorted(set(config.datasets) - set(DATASETS) | ({"composite"} & set(config.datasets)))
    if unknown:
        raise ConfigError(
            f"data.reasoning_gym.datasets: {', '.join(unknown)} is not one of reasoning-gym's datasets "
            f"({', '.join(sorted(set(DATASETS) - {'composite'}))})"
        )
    specs = [DatasetSpec(name, spec.weight, dict(spec.config)) for name, spec in config.datasets.items()]
    try:
        return reasoning_gym.create_dataset(
            "composite", seed=config.seed, size=config.size + config.val_size, datasets=specs
        )
    except (
        AssertionError,
        TypeError,
        ValueError,
    ) as error:  # a config field it does not know, or a bad value
        raise ConfigError(
            f"data.reasoning_gym.datasets: reasoning-gym refused the config ({type(error).__name__}: {error})"
        ) from None


def mix_row(mix, config: ReasoningGymConfig, index: int, split: str, system: str) -> dict:
    """Entry `index` of the mix as a VeRL-schema row (see the module docstring)."""
    from rlfabric.reward.reasoning_gym import DATA_SOURCE_PREFIX, entry_source

    entry = mix[index]
    name = entry["metadata"]["source_dataset"]
    dataset = mix.datasets[name]
    source = entry_source(name, dict(config.datasets[name].config), dataset.seed, dataset.size, index)
    prompt = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": entry["question"]}
    ]
    return {
        "data_source": DATA_SOURCE_PREFIX + name,
        "prompt": prompt,
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": source.ground_truth()},
        "extra_info": {"split": split, "index": index, "dataset": name},
    }


def write_reasoning_gym(out_dir: str | Path, config: ReasoningGymConfig) -> dict[str, Path]:
    """train.parquet (and val.parquet when val_size > 0 leaves rows) in out_dir; their paths by split."""
    mix = build_mix(config)
    system = system_message(config)
    train = [mix_row(mix, config, index, "train", system) for index in range(config.size)]
    seen = {(row["data_source"], json.dumps(row["prompt"])) for row in train}
    val = [
        row
        for row in (
            mix_row(mix, config, index, "val", system)
            for index in range(config.size, config.size + config.val_size)
        )
        if (row["data_source"], json.dumps(row["prompt"])) not in seen
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in (("train", train), ("val", val)):
        if rows:
            paths[split] = out / f"{split}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths
