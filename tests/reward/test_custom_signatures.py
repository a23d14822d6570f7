"""reward.custom_signature: the tutorial's reward files (examples/rewards) in the real sandboxed pool, as
VeRL's compute_score and as a TRL reward function; a function of the other style fails its load with a
message naming the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rlfabric.reward import STATUS_ERROR, STATUS_OK, CustomFunctionLoadError, CustomScorerPool, ScoreItem
from rlfabric.reward.signatures import SignatureMismatch, caller, check_signature

REWARDS = Path(__file__).resolve().parents[2] / "examples" / "rewards"


def capital(response: str, answer: str = "Buenos Aires") -> ScoreItem:
    """A row as `rlfabric data custom` writes it from examples/data/capitals.jsonl."""
    return ScoreItem("capitals", response, answer, prompt="What is the capital of Argentina?",
                     extra_info={"split": "train", "index": 0, "answer": answer, "country": "Argentina"})


REPLIES = ["Buenos Aires", "The capital is buenos aires.", "Buenos", "Lima"]


def test_the_compute_score_example_gives_a_score_and_its_extra_metric():
    with CustomScorerPool(str(REWARDS / "capitals.py"), "compute_score", num_workers=2, timeout_s=5) as pool:
        results = pool.score_batch([capital(reply) for reply in REPLIES])
    assert [r.status for r in results] == [STATUS_OK] * 4
    assert [r.score for r in results] == [1.0, 1.0, 0.0, 0.0]
    assert [r.metrics for r in results] == [{"exact_match": m} for m in (1.0, 0.0, 0.0, 0.0)]


def test_the_trl_example_gets_prompts_completions_and_the_rows_columns():
    with CustomScorerPool(str(REWARDS / "capitals_trl.py"), "capital_named", num_workers=2, timeout_s=5,
                          signature="trl") as pool:
        results = pool.score_batch([capital(reply) for reply in REPLIES])
    assert [(r.status, r.score) for r in results] == [(STATUS_OK, 1.0), (STATUS_OK, 1.0), (STATUS_OK, 0.0),
                                                     (STATUS_OK, 0.0)]


TRL_FILE = textwrap.dedent(
    """
    def echo(prompts, completions, ground_truth, data_source, country, scale=1.0, **kwargs):
        assert isinstance(prompts, list) and isinstance(country, list) and "split" in kwargs
        return [scale * (len(p) + len(c)) + (c == ground_truth[0]) for p, c in zip(prompts, completions)]

    def two_scores(prompts, completions, **kwargs):
        return [1.0, 2.0]

    def not_applicable(prompts, completions, **kwargs):
        return [None]

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return 1.0
    """
)


@pytest.fixture(scope="module")
def trl_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("trl") / "rewards.py"
    path.write_text(TRL_FILE)
    return str(path)


def test_trl_arguments_and_custom_kwargs_reach_the_function(trl_file):
    with CustomScorerPool(trl_file, "echo", num_workers=1, timeout_s=5, signature="trl",
                          function_kwargs={"scale": 0.5}) as pool:
        result = pool.score_batch([capital("Buenos Aires")])[0]
    prompt = "What is the capital of Argentina?"
    assert (result.status, result.score) == (STATUS_OK, 0.5 * (len(prompt) + len("Buenos Aires")) + 1)


@pytest.mark.parametrize(("name", "message"), [
    ("two_scores", "given 1 completion and returned 2 values"),
    ("not_applicable", "returned None"),
])
def test_a_trl_result_that_is_not_one_score_fails_its_item(trl_file, name, message):
    with CustomScorerPool(trl_file, name, num_workers=1, timeout_s=5, signature="trl") as pool:
        result = pool.score_batch([capital("Lima")])[0]
    assert result.status == STATUS_ERROR and message in result.message


def test_a_function_of_the_other_style_fails_the_load_naming_the_key(trl_file):
    with pytest.raises(CustomFunctionLoadError, match="reward.custom_signature: trl"):
        CustomScorerPool(str(REWARDS / "capitals_trl.py"), "capital_named", num_workers=1, timeout_s=5)
    with pytest.raises(CustomFunctionLoadError, match="reward.custom_signature: verl"):
        CustomScorerPool(trl_file, "compute_score", num_workers=1, timeout_s=5, signature="trl")


def test_signature_checks_in_process():
    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    def anything(*args, **kwargs):
        return [1.0]

    check_signature(verl, "verl", "verl")
    check_signature(anything, "verl", "anything")
    check_signature(anything, "trl", "anything")  # **kwargs takes completions
    with pytest.raises(SignatureMismatch, match="no 'completions' parameter"):
        check_signature(verl, "trl", "verl")
    def token_level(prompts, completions, completion_ids, trainer_state=None, **kwargs):
        return [1.0]

    with pytest.raises(SignatureMismatch, match="needs completion_ids, which rlfabric does not pass"):
        check_signature(token_level, "trl", "token_level")
    with pytest.raises(ValueError, match="custom_signature must be one of"):
        caller(verl, "openai", {})
