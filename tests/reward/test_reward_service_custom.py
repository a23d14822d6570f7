"""A custom reward function behind RewardService: per-item statuses for success, exception,
timeout and crash, the failure metric by reason, and the next request still works."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from rlfabric.core.config import RewardConfig
from rlfabric.reward import STATUS_CRASHED, STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, ScoreItem
from rlfabric.reward.engine import RewardEngine

USER_FILE = textwrap.dedent(
    """
    import os
    import time


    def my_reward(data_source, solution_str, ground_truth, extra_info, bonus=0.0):
        mode = extra_info["mode"]
        if mode == "exact":
            return float(solution_str == ground_truth) + bonus
        if mode == "dict":
            return {"score": 0.5, "length": len(solution_str), "source_len": len(data_source)}
        if mode == "raise":
            raise ValueError("cannot parse the answer")
        if mode == "sleep":
            time.sleep(60)
        if mode == "exit":
            os._exit(3)
    """
)


def item(mode: str, response: str = "42") -> ScoreItem:
    return ScoreItem("any/source", response, "42", extra_info={"mode": mode})


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


@pytest.fixture
def custom(reward_server, user_file):
    return reward_server(
        custom_path=user_file,
        custom_name="my_reward",
        custom_kwargs={"bonus": 0.25},
        num_workers=2,
        timeout_s=1.0,
        memory_limit_mb=1024,
    )


def test_success_exception_timeout_and_crash_per_item(custom):
    results = custom.score([item("exact"), item("raise"), item("sleep"), item("exit"), item("dict", "abc")])
    assert [r.status for r in results] == [STATUS_OK, STATUS_ERROR, STATUS_TIMEOUT, STATUS_CRASHED, STATUS_OK]
    assert [r.score for r in results] == [1.25, 0.0, 0.0, 0.0, 0.5]
    assert "ValueError: cannot parse the answer" in results[1].message
    assert "no result within 1 s" in results[2].message and "exited with code 3" in results[3].message
    assert results[4].metrics == {"length": 3.0, "source_len": float(len("any/source"))}

    for reason in ("error", "timeout", "crashed"):
        assert custom.metric("rlfabric_reward_failures_total", reason=reason) == 1.0
    assert custom.metric("rlfabric_reward_items_total") == 5.0
    status = custom.status()
    assert (status.items_scored, status.items_failed) == (5, 3)

    # The killed workers were replaced: the next request is served normally.
    again = custom.score([item("exact"), item("exact", "41"), item("dict")])
    assert [(r.status, r.score) for r in again] == [(STATUS_OK, 1.25), (STATUS_OK, 0.25), (STATUS_OK, 0.5)]
    assert custom.status().items_failed == 3


def test_every_data_source_goes_to_the_custom_function(custom):
    # No registered scorer is needed (VeRL's custom_reward_function replaces the built-in dispatch).
    result = custom.score([ScoreItem("never/registered", "42", "42", extra_info={"mode": "exact"})])[0]
    assert (result.status, result.score) == (STATUS_OK, 1.25)


def test_missing_custom_file_fails_start(tmp_path):
    engine = RewardEngine(RewardConfig(custom_path=str(tmp_path / "missing.py")))
    with pytest.raises(FileNotFoundError, match="missing.py"):
        asyncio.run(engine.start())


TRL_FILE = textwrap.dedent(
    """
    def prompt_words(prompts, completions, ground_truth, **columns):
        return [len(p.split()) + (c == t) + len(columns["mode"][0]) for p, c, t in zip(prompts, completions, ground_truth)]
    """
)


def test_a_trl_function_gets_the_prompt_and_columns_sent_over_grpc(reward_server, tmp_path):
    path = tmp_path / "trl_reward.py"
    path.write_text(TRL_FILE)
    served = reward_server(custom_path=str(path), custom_name="prompt_words", custom_signature="trl")
    items = [ScoreItem("any/source", response, "42", extra_info={"mode": "exact"}, prompt="three word prompt")
             for response in ("42", "41")]
    assert [(r.status, r.score) for r in served.score(items)] == [(STATUS_OK, 3 + 1 + 5), (STATUS_OK, 3 + 5)]
