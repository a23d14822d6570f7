"""reasoning-gym's datasets, scored by the library's own scorers (the extra `rlfabric[reasoning-gym]`).

A row of data_source "reasoning_gym/<name>" (rlfabric.data.reasoning_gym writes them) carries in
reward_model.ground_truth not the answer but where its entry comes from, as a JSON object:

    {"dataset": "chain_sum", "config": {"max_terms": 3}, "seed": 43, "size": 1100, "index": 17}

The scorer rebuilds the dataset with reasoning_gym.create_dataset(dataset, seed=, size=, **config), regenerates
entry `index`, reads the answer out of the response with reasoning_gym.utils.extract_answer (the text of the
last <answer>...</answer>, stripped; None when there is none) and returns the dataset's score_answer(answer,
entry). Many scorers read the dataset's config or state, so the score of a library default dataset
(get_score_answer_fn) would be wrong for a configured one. Built datasets and regenerated entries are kept in
bounded LRU caches: a GRPO group scores one entry rollout.n times, and some entries take a second to generate.
Importing this module registers a scorer for every dataset the library registers ("composite" included: its
config's datasets are a list of {name, weight, config}).
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import reasoning_gym
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer

from rlfabric.reward.registry import register_scorer

DATA_SOURCE_PREFIX = "reasoning_gym/"
DATASETS_CACHED = 64  # built datasets kept (some hold tables or data files: a few MB each at most)
ENTRIES_CACHED = 8192  # regenerated entries kept (a few KB each)
_FIELDS = {"dataset": str, "config": dict, "seed": int, "size": int, "index": int}


@dataclass(frozen=True)
class EntrySource:
    """Where an entry comes from: the dataset's name, config (as canonical JSON), seed and size, and its index."""

    dataset: str
    config_json: str
    seed: int
    size: int
    index: int

    @property
    def dataset_key(self) -> tuple[str, str, int, int]:
        return self.dataset, self.config_json, self.seed, self.size

    def ground_truth(self) -> str:
        """The JSON a row's reward_model.ground_truth holds."""
        return json.dumps(
            {
                "dataset": self.dataset,
                "config": json.loads(self.config_json),
                "seed": self.seed,
                "size": self.size,
                "index": self.index,
            },
            sort_keys=True,
        )


def entry_source(dataset: str, config: dict[str, Any], seed: int, size: int, index: int) -> EntrySource:
    return EntrySource(dataset, json.dumps(config, sort_keys=True), seed, size, index)


def parse_ground_truth(ground_truth: Any) -> EntrySource:
    """The EntrySource a ground truth names; ValueError saying which field is missing or wrong."""
    try:
        fields = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    except ValueError:
        raise ValueError(
            f"a reasoning_gym ground truth is a JSON object, got {str(ground_truth)[:80]!r}"
        ) from None
    if not isinstance(fields, dict):
        raise ValueError(f"a reasoning_gym ground truth is a JSON object, got {type(fields).__name__}")
    for name, kind in _FIELDS.items():
        value = fields.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(
                f"reasoning_gym ground truth field {name!r}: expected {kind.__name__}, got {value!r}"
            )
    if not 0 <= fields["index"] < fields["size"]:
        raise ValueError(f"reasoning_gym ground truth: index {fields['index']} outside size {fields['size']}")
    return entry_source(fields["dataset"], fields["config"], fields["seed"], fields["size"], fields["index"])


def create_dataset(
    name: str, config: dict[str, Any], seed: int, size: int
) -> reasoning_gym.dataset.ProceduralDataset:
    """reasoning_gym.create_dataset, with composite's dataset specs given as JSON objects."""
    if name == "composite":
        config = {**config, "datasets": [DatasetSpec(**spec) for spec in config.get("datasets", [])]}
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)


class _LRU:
    """A bounded map, least recently used out first; its callers hold the cache's lock."""

    def __init__(self, capacity: int):
        self.capacity, self.items = capacity, OrderedDict()

    def get(self, key: Hashable) -> Any:
        value = self.items.get(key)
        if value is not None:
            self.items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self.items[key] = value
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)


class EntryCache:
    """Datasets rebuilt and entries regenerated from EntrySources, the most recent kept."""

    def __init__(self, datasets: int = DATASETS_CACHED, entries: int = ENTRIES_CACHED):
        # One lock: generating is CPU-bound under the GIL anyway, and some generators share state per dataset.
        self._lock = threading.Lock()
        self._datasets, self._entries = _LRU(datasets), _LRU(entries)

    def get(self, source: EntrySource) -> tuple[Any, dict[str, Any]]:
        """The dataset and a copy of its entry (a scorer may change the entry it is given)."""
        with self._lock:
            dataset = self._datasets.get(source.dataset_key)
            if dataset is None:
                dataset = create_dataset(
                    source.dataset, json.loads(source.config_json), source.seed, source.size
                )
                self._datasets.put(source.dataset_key, dataset)
            entry = self._entries.get(source)
            if entry is None:
                entry = dataset[source.index]
                self._entries.put(source, entry)
        return dataset, copy.deepcopy(entry)


ENTRIES = EntryCache()


def score(dataset_name: str, solution_str: str, ground_truth: Any) -> float:
    """The library's score of the response's <answer> on the entry the ground truth names."""
    source = parse_ground_truth(ground_truth)
    if source.dataset != dataset_name:
        raise ValueError(
            f"the ground truth names dataset {source.dataset!r}, the data_source "
            f"{DATA_SOURCE_PREFIX}{dataset_name}"
        )
    dataset, entry = ENTRIES.get(source)
    return float(dataset.score_answer(extract_answer(solution_str), entry))


def _scorer(dataset_name: str):
    def compute_score(
        solution_str: str, ground_truth: Any, extra_info: dict | None = None, **unused: Any
    ) -> float:
        return score(dataset_name, solution_str, ground_truth)

    compute_score.__name__ = f"score_{dataset_name}"
    return compute_score


for _name in DATASETS:
    register_scorer(DATA_SOURCE_PREFIX + _name, _scorer(_name), replace=True)
