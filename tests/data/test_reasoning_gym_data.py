"""data.builtin_task reasoning_gym: rows in VeRL's schema from reasoning-gym's composite, train and val apart, and
what reaches agent code holds neither the answer nor the ground truth."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

pytest.importorskip("reasoning_gym")  # the extra rlfabric[reasoning-gym]; in the dev install

import reasoning_gym  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS  # noqa: E402

from rlfabric.coordinator.agent_episodes import agent_task  # noqa: E402
from rlfabric.coordinator.setup import load_datasets  # noqa: E402
from rlfabric.core.config import ConfigError, config_from_dict  # noqa: E402
from rlfabric.core.errors import InvalidArgument  # noqa: E402
from rlfabric.data.reasoning_gym import write_reasoning_gym  # noqa: E402
from rlfabric.quickstart.tiny_model import build_tokenizer  # noqa: E402
from rlfabric.reward.registry import get_scorer  # noqa: E402

MIX = {
    "chain_sum": {"weight": 2.0, "config": {"max_terms": 3, "max_digits": 2}},
    "word_sorting": {"weight": 1.0},
    "countdown": {"weight": 1.0},
}


def data_config(**overrides):
    section = {"datasets": MIX, "seed": 5, "size": 60, "val_size": 20, **overrides}
    return config_from_dict({"data": {"builtin_task": "reasoning_gym", "reasoning_gym": section}}).data


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    config = data_config()
    paths = write_reasoning_gym(tmp_path_factory.mktemp("rg"), config.reasoning_gym)
    return config, {split: pq.read_table(path).to_pylist() for split, path in paths.items()}


def test_rows_follow_verls_schema_and_name_their_entry_not_its_answer(written):
    config, rows = written
    assert len(rows["train"]) == 60 and 0 < len(rows["val"]) <= 20
    assert {row["data_source"] for row in rows["train"]} == {f"reasoning_gym/{name}" for name in MIX}
    for split in ("train", "val"):
        for row in rows[split]:
            name = row["data_source"].removeprefix("reasoning_gym/")
            truth = json.loads(row["reward_model"]["ground_truth"])
            assert set(truth) == {"dataset", "config", "seed", "size", "index"} and truth["dataset"] == name
            assert truth["config"] == MIX[name].get("config", {}) and truth["size"] == 80
            assert row["extra_info"] == {"split": split, "index": truth["index"], "dataset": name}
            assert row["ability"] == "reasoning" and row["reward_model"]["style"] == "rule"
            assert row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPTS["default"]}
            # the entry the ground truth names is the one whose question the row asks
            entry = reasoning_gym.create_dataset(name, seed=truth["seed"], size=80, **truth["config"])[
                truth["index"]
            ]
            assert row["prompt"][1] == {"role": "user", "content": entry["question"]}
            # and its own answer scores 1 through the registered scorer
            assert get_scorer(row["data_source"])(f"<answer>{entry['answer']}</answer>", truth) == 1.0


def test_train_and_val_share_no_entry_and_no_question(written):
    _, rows = written
    indices = {split: {row["extra_info"]["index"] for row in rows[split]} for split in rows}
    assert indices["train"] == set(range(60)) and indices["val"] <= set(range(60, 80))
    questions = {split: {row["prompt"][-1]["content"] for row in rows[split]} for split in rows}
    assert not questions["train"] & questions["val"]


def test_the_same_config_writes_the_same_rows(written, tmp_path):
    config, rows = written
    again = pq.read_table(write_reasoning_gym(tmp_path, config.reasoning_gym)["train"]).to_pylist()
    assert again == rows["train"]


def test_agent_payloads_hold_no_answer_and_no_ground_truth(written, tmp_path):
    config, _ = written
    run = config_from_dict(
        {"data": {**config.model_dump(), "max_prompt_length": 4096, "train_batch_size": 8}}
    )
    train, val = load_datasets(run, tmp_path, build_tokenizer())
    checked = 0
    for row in [*train.rows, *val.rows]:
        payload = json.dumps(agent_task(row))
        truth = json.loads(row.ground_truth)
        entry = reasoning_gym.create_dataset(
            truth["dataset"], seed=truth["seed"], size=truth["size"], **truth["config"]
        )[truth["index"]]
        assert row.ground_truth not in payload and "ground_truth" not in payload
        assert "metadata" not in payload
        if entry["answer"] not in entry["question"] and len(entry["answer"]) > 2:  # "7" may be in any prompt
            assert entry["answer"] not in payload
            checked += 1
    assert checked >= len(train.rows) // 2  # most answers are distinctive enough to look for


def test_a_system_prompt_of_your_own_or_none(tmp_path):
    rows = pq.read_table(
        write_reasoning_gym(tmp_path / "a", data_config(system_prompt="Be brief.").reasoning_gym)["train"]
    ).to_pylist()
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    rows = pq.read_table(
        write_reasoning_gym(tmp_path / "b", data_config(system_prompt="").reasoning_gym)["train"]
    ).to_pylist()
    assert [message["role"] for message in rows[0]["prompt"]] == ["user"]


def test_bad_configs_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.reasoning_gym\.datasets: no_such_set is not one of"):
        write_reasoning_gym(tmp_path, data_config(datasets={"no_such_set": {}}).reasoning_gym)
    with pytest.raises(ConfigError, match=r"data\.reasoning_gym\.datasets: reasoning-gym refused"):
        write_reasoning_gym(
            tmp_path, data_config(datasets={"chain_sum": {"config": {"max_terms": 0}}}).reasoning_gym
        )
    with pytest.raises(ConfigError, match="seed"):
        data_config(datasets={"chain_sum": {"config": {"seed": 3}}})
    with pytest.raises(ConfigError, match=r"data\.reasoning_gym\.datasets"):
        config_from_dict({"data": {"builtin_task": "reasoning_gym"}})
    # at a run's start the same error is the StartRun's INVALID_ARGUMENT
    run = config_from_dict(
        {"data": {"builtin_task": "reasoning_gym", "reasoning_gym": {"datasets": {"nope": {}}}}}
    )
    with pytest.raises(InvalidArgument, match="nope"):
        load_datasets(run, tmp_path, build_tokenizer())


def test_rlfabric_check_names_a_dataset_the_library_lacks_before_anything_starts():
    import yaml

    from rlfabric.core.config import load_run_config
    from rlfabric.core.config.loading import default_config_path
    from rlfabric.launch.preflight import check_run

    def problems(datasets):
        tree = yaml.safe_load(default_config_path().read_text())
        tree["data"].update(builtin_task="reasoning_gym", reasoning_gym={"datasets": datasets})
        return check_run(load_run_config(tree), ("files",)).problems

    assert problems({"chain_sum": {}}) == []
    (problem,) = problems({"chain_sums": {}})
    assert problem.startswith(
        "data.reasoning_gym.datasets: chain_sums is not one of reasoning-gym's datasets"
    )
