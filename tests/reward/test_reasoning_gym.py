"""reasoning-gym rows scored by the reward service equal the library's own scorer on the same entry.

Every dataset reasoning-gym registers (composite included) gives ENTRIES_PER_DATASET entries, each answered four
ways: right (its own answer in <answer> tags), wrong (another entry's answer), garbage (no tags) and mixed
(a wrong answer tagged first, then the right one, amid prose). Each (response, entry) pair goes through the
reward service's real path in this process (LocalRewardClient -> RewardEngine -> the registry's scorer, which
rebuilds the dataset from the ground truth and regenerates the entry), and the library is asked independently:
dataset.score_answer(extract_answer(response), entry) on a dataset this test builds itself.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import string

import pytest

pytest.importorskip("reasoning_gym")  # the extra rlfabric[reasoning-gym]; in the dev install

import reasoning_gym  # noqa: E402
from reasoning_gym.composite import DatasetSpec  # noqa: E402
from reasoning_gym.factory import DATASETS  # noqa: E402
from reasoning_gym.utils import extract_answer  # noqa: E402

from rlfabric.core.config import RewardConfig  # noqa: E402
from rlfabric.reward import STATUS_ERROR, STATUS_OK, ScoreItem  # noqa: E402
from rlfabric.reward.client import LocalRewardClient  # noqa: E402
from rlfabric.reward.engine import RewardEngine  # noqa: E402
from rlfabric.reward.reasoning_gym import EntryCache, entry_source, parse_ground_truth  # noqa: E402
from rlfabric.reward.registry import get_scorer  # noqa: E402

ENTRIES_PER_DATASET = 3
SIZE = 1000
KINDS = ("right", "wrong", "garbage", "mixed")
NO_ORACLE = {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}
# composite's own config: sub-datasets as JSON objects, as a row's ground truth carries them
COMPOSITE_CONFIG = {
    "datasets": [
        {"name": "chain_sum", "weight": 1.0, "config": {"max_terms": 3}},
        {"name": "letter_counting", "weight": 1.0, "config": {}},
        {"name": "word_sorting", "weight": 2.0, "config": {}},
    ]
}


def library_dataset(name: str, config: dict, seed: int):
    if name == "composite":
        config = {"datasets": [DatasetSpec(**spec) for spec in config["datasets"]]}
    return reasoning_gym.create_dataset(name, seed=seed, size=SIZE, **config)


def responses(entry: dict, other: dict, rng: random.Random) -> dict[str, str]:
    right, wrong = str(entry["answer"]), str(other["answer"])
    if wrong == right:
        wrong = right + "0"
    garbage = "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 40))).replace("<", "(")
    mixed = (
        f"Let me think. First guess: <answer>{wrong}</answer>. No, checking again, the result is\n"
        f"<answer> {right} </answer>\nThat is my final answer."
    )
    return {
        "right": f"<answer>{right}</answer>",
        "wrong": f"<answer>{wrong}</answer>",
        "garbage": garbage,
        "mixed": mixed,
    }


def library_score(dataset, response: str, entry: dict) -> tuple[str, float]:
    try:
        return STATUS_OK, float(dataset.score_answer(extract_answer(response), copy.deepcopy(entry)))
    except Exception:  # the reward service gives such an item status error and score 0
        return STATUS_ERROR, 0.0


@pytest.fixture(scope="module")
def pairs() -> list[tuple[str, str, ScoreItem, tuple[str, float]]]:
    """(dataset, kind, item, the library's (status, score)) for every pair."""
    rng = random.Random(47)
    out = []
    for number, name in enumerate(sorted(DATASETS)):
        config = COMPOSITE_CONFIG if name == "composite" else {}
        seed = 1000 + number
        dataset = library_dataset(name, config, seed)
        indices = rng.sample(range(SIZE), ENTRIES_PER_DATASET + 1)
        entries = [dataset[index] for index in indices]
        for position, index in enumerate(indices[:-1]):
            entry, other = entries[position], entries[position + 1]
            ground_truth = json.dumps(
                {"dataset": name, "config": config, "seed": seed, "size": SIZE, "index": index}
            )
            for kind, response in responses(entry, other, rng).items():
                item = ScoreItem(f"reasoning_gym/{name}", response, ground_truth, {"dataset": name})
                out.append((name, kind, item, library_score(dataset, response, entry)))
    return out


def score_through_the_service(items: list[ScoreItem]) -> list:
    async def run():
        engine = RewardEngine(RewardConfig())
        await engine.start()
        try:
            client = LocalRewardClient(engine)
            chunk = engine.config.max_items_per_request
            return [
                result
                for start in range(0, len(items), chunk)
                for result in await client.score(items[start : start + chunk])
            ]
        finally:
            await engine.stop()

    return asyncio.run(run())


@pytest.mark.slow  # 1,000 pairs, ~10 s
def test_the_reward_service_agrees_with_the_library_on_every_pair(pairs):
    assert len(pairs) >= 1000
    assert {name for name, *_ in pairs} == set(DATASETS)  # every dataset the library registers
    results = score_through_the_service([item for _, _, item, _ in pairs])
    disagreements = [
        (name, kind, item.response[:60], expected, (result.status, result.score))
        for (name, kind, item, expected), result in zip(pairs, results, strict=True)
        if (result.status, result.score) != expected
    ]
    assert not disagreements, disagreements[:10]
    # not a comparison of zeros: right answers score, and more than wrong ones and garbage do
    by_kind = {kind: [score for _, k, _, (_, score) in pairs if k == kind] for kind in KINDS}
    mean = {kind: sum(scores) / len(scores) for kind, scores in by_kind.items()}
    assert mean["right"] > mean["wrong"] and mean["right"] > mean["garbage"], mean
    # every dataset scores its own answer 1.0 but the five with no single oracle answer, whose scorers simulate
    full = {name for name, kind, _, (_, score) in pairs if kind == "right" and score == 1.0}
    assert set(DATASETS) - full <= NO_ORACLE, sorted(set(DATASETS) - full)


def test_a_config_the_scorer_reads_changes_the_score_as_the_library_says():
    # chain_sum's default config vs. one whose entries differ: the ground truth's config is what is rebuilt
    config = {"min_terms": 5, "max_terms": 5, "min_digits": 3, "max_digits": 3}
    dataset = reasoning_gym.create_dataset("chain_sum", seed=3, size=10, **config)
    entry = dataset[4]
    truth = entry_source("chain_sum", config, 3, 10, 4).ground_truth()
    score = get_scorer("reasoning_gym/chain_sum")
    assert score(f"<answer>{entry['answer']}</answer>", truth) == 1.0
    default = reasoning_gym.create_dataset("chain_sum", seed=3, size=10)[4]
    assert default["answer"] != entry["answer"]
    assert score(f"<answer>{default['answer']}</answer>", truth) == 0.0


@pytest.mark.parametrize(
    "ground_truth, problem",
    [
        ("7", "a JSON object"),
        ('{"dataset": "chain_sum", "config": {}, "seed": 1, "size": 10}', "'index'"),
        ('{"dataset": "chain_sum", "config": {}, "seed": 1, "size": 10, "index": 10}', "outside size 10"),
        ('{"dataset": "chain_sum", "config": [], "seed": 1, "size": 10, "index": 0}', "'config'"),
    ],
)
def test_a_bad_ground_truth_is_an_error_that_names_the_field(ground_truth, problem):
    with pytest.raises(ValueError, match=problem):
        parse_ground_truth(ground_truth)


def test_a_ground_truth_of_another_dataset_fails_its_item_not_silently():
    truth = entry_source("chain_sum", {}, 1, 10, 0).ground_truth()
    results = score_through_the_service([ScoreItem("reasoning_gym/countdown", "<answer>1</answer>", truth)])
    assert results[0].status == STATUS_ERROR and "chain_sum" in results[0].message


def test_the_caches_are_bounded_and_hand_out_copies():
    cache = EntryCache(datasets=2, entries=3)
    sources = [entry_source("chain_sum", {}, seed, 10, index) for seed in range(3) for index in range(2)]
    for source in sources:
        cache.get(source)
    assert len(cache._datasets.items) == 2 and len(cache._entries.items) == 3
    _, entry = cache.get(sources[-1])
    entry["answer"] = "changed"
    assert cache.get(sources[-1])[1]["answer"] != "changed"


def test_an_unknown_dataset_is_refused_before_scoring_and_the_advice_names_the_extra():
    from rlfabric.reward.engine import unscored_sources, unscored_sources_advice

    config = RewardConfig()
    sources = ["reasoning_gym/chain_sum", "reasoning_gym/no_such_set"]
    assert unscored_sources(config, sources) == ["reasoning_gym/no_such_set"]
    assert "pip install 'rlfabric[reasoning-gym]'" in unscored_sources_advice(
        config, ["reasoning_gym/no_such_set"]
    )


def test_a_family_whose_library_is_missing_says_which_extra_installs_it(monkeypatch):
    from rlfabric.reward import registry

    monkeypatch.setitem(registry.SCORER_FAMILIES, "other_gym/", ("no_such_module_for_this_test", "other-gym"))
    with pytest.raises(registry.UnknownDataSourceError, match=r"pip install 'rlfabric\[other-gym\]'"):
        registry.get_scorer("other_gym/x")
    assert not registry.has_scorer("other_gym/x")
