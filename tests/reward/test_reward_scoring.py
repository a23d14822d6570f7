"""compute_score dispatch, the registry, score_items and the overlong penalty."""

import math
import time
import uuid

import pytest

from rlfabric.reward import (
    STATUS_ERROR,
    STATUS_OK,
    OverlongConfig,
    ScoreItem,
    ScoringConfig,
    UnknownDataSourceError,
    apply_overlong_penalty,
    compute_score,
    default_compute_score,
    get_scorer,
    overlong_penalty,
    register_scorer,
    registered_data_sources,
    score_items,
)

MATH_SOURCES = ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]


# --- compute_score (VeRL's default_compute_score) ---


def test_gsm8k_dispatch_returns_float():
    score = compute_score("openai/gsm8k", "so #### 72", "72")
    assert score == 1.0 and isinstance(score, float)
    assert compute_score("openai/gsm8k", "so #### 71", "72") == 0.0


def test_gsm8k_method_kwarg():
    assert compute_score("openai/gsm8k", "The answer is 72", "72") == 0.0
    assert compute_score("openai/gsm8k", "The answer is 72", "72", method="flexible") == 1.0


@pytest.mark.parametrize("data_source", MATH_SOURCES)
def test_math_dispatch(data_source):
    assert compute_score(data_source, "$\\boxed{\\frac12}$", "0.5") == 1.0
    assert compute_score(data_source, "$\\boxed{\\frac13}$", "0.5") == 0.0


def test_unknown_data_source_raises_not_implemented_naming_it():
    with pytest.raises(NotImplementedError, match="my/unknown-source"):
        compute_score("my/unknown-source", "#### 1", "1")
    with pytest.raises(UnknownDataSourceError):
        get_scorer("my/unknown-source")


def test_default_compute_score_alias():
    assert default_compute_score("openai/gsm8k", "#### 3", "3", extra_info={"split": "test"}) == 1.0


# --- registry ---


def test_register_scorer_receives_arguments_and_dict_passes_through():
    calls = []

    def scorer(solution_str, ground_truth, extra_info=None, **kwargs):
        calls.append((solution_str, ground_truth, extra_info, kwargs))
        return {"score": 0.25, "acc": True}

    register_scorer("test/registry-dict", scorer, replace=True)
    assert "test/registry-dict" in registered_data_sources()
    assert get_scorer("test/registry-dict") is scorer
    result = compute_score("test/registry-dict", "resp", "gt", {"k": 1}, temperature=2)
    assert result == {"score": 0.25, "acc": True}
    assert calls == [("resp", "gt", {"k": 1}, {"temperature": 2})]


def test_register_scorer_refuses_a_taken_name_unless_replace():
    name = f"test/registry-replace-{uuid.uuid4()}"
    register_scorer(name, lambda s, g, e: 1)
    with pytest.raises(ValueError, match="already registered"):
        register_scorer(name, lambda s, g, e: 2)
    register_scorer(name, lambda s, g, e: (3, "extra"), replace=True)
    assert compute_score(name, "r", "g") == 3.0  # a sequence's first element, as VeRL
    with pytest.raises(TypeError):
        register_scorer("test/registry-not-callable", 1.0)


def test_builtin_sources_are_registered():
    assert {"openai/gsm8k", *MATH_SOURCES} <= set(registered_data_sources())


# --- score_items ---


def test_score_items_mixed_batch_in_order():
    items = [
        ScoreItem("openai/gsm8k", "#### 5", "5"),
        ScoreItem("lighteval/MATH", "\\boxed{2}", "3"),
        ScoreItem("openai/gsm8k", "#### 4", "5"),
        ScoreItem("HuggingFaceH4/MATH-500", "\\boxed{\\dfrac{1}{2}}", "\\frac12"),
    ]
    results = score_items(items)
    assert [r.score for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert all(r.status == STATUS_OK and r.message == "" for r in results)


def test_score_items_passes_compute_score_kwargs():
    items = [ScoreItem("openai/gsm8k", "it is 9", "9")]
    assert score_items(items)[0].score == 0.0
    flexible = ScoringConfig(compute_score_kwargs={"method": "flexible"})
    assert score_items(items, flexible)[0].score == 1.0


def test_score_items_unknown_source_fails_batch_or_uses_default():
    items = [ScoreItem("openai/gsm8k", "#### 5", "5"), ScoreItem("nobody/knows", "x", "y")]
    with pytest.raises(UnknownDataSourceError, match="nobody/knows"):
        score_items(items)
    results = score_items(items, ScoringConfig(default_score_for_unknown=-1.0))
    assert results[0].score == 1.0
    assert results[1].score == -1.0 and results[1].status == STATUS_OK
    assert "nobody/knows" in results[1].message


def test_score_items_scorer_errors_are_per_item():
    def scorer(solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise ZeroDivisionError("division by zero")
        if solution_str == "nan":
            return math.nan
        if solution_str == "nokey":
            return {"acc": 1.0}
        if solution_str == "text":
            return "1.0"
        return {"score": 1.0, "acc": 1, "correct": True, "note": "not a number"}

    register_scorer("test/score-items-errors", scorer, replace=True)
    items = [
        ScoreItem("test/score-items-errors", text, "") for text in ["ok", "boom", "nan", "nokey", "text"]
    ]
    results = score_items(items)
    assert results[0].status == STATUS_OK and results[0].score == 1.0
    assert results[0].metrics == {"acc": 1.0, "correct": 1.0}  # numeric entries only
    assert [r.status for r in results[1:]] == [STATUS_ERROR] * 4
    assert all(r.score == 0.0 for r in results[1:])
    assert "ZeroDivisionError" in results[1].message
    assert "non-finite" in results[2].message
    assert "score" in results[3].message
    assert "str" in results[4].message


def test_score_items_gsm8k_throughput():
    # The service targets >= 5,000 GSM8K items/s on 2 cores; the in-process path must be far above that.
    response = "Natalia sold 48 clips in April and half as many in May. 48 + 24 = 72.\n#### 72"
    items = [ScoreItem("openai/gsm8k", response, "72")] * 20_000
    start = time.perf_counter()
    results = score_items(items)
    elapsed = time.perf_counter() - start
    assert all(r.score == 1.0 for r in results)
    assert elapsed < 2.0, f"{len(items) / elapsed:.0f} items/s"


# --- overlong penalty ---


@pytest.mark.parametrize(
    ("length", "expected"),
    [(50, 0.0), (80, 0.0), (85, -0.25), (90, -0.5), (100, -1.0), (110, -1.5)],
)
def test_overlong_penalty(length, expected):
    # Lmax = 100, b = 20: no penalty up to 80 tokens, then -1/20 per token.
    assert overlong_penalty(
        length, max_response_length=100, buffer_length=20, penalty_factor=1.0
    ) == pytest.approx(expected)


def test_overlong_penalty_factor_scales():
    assert overlong_penalty(90, 100, 20, penalty_factor=2.0) == pytest.approx(-1.0)


def test_apply_overlong_penalty():
    config = OverlongConfig(enable=True, max_response_length=100, buffer_length=20, penalty_factor=1.0)
    assert apply_overlong_penalty(1.0, 90, config) == pytest.approx((0.5, -0.5))
    assert apply_overlong_penalty(1.0, 90, OverlongConfig(enable=False)) == (1.0, 0.0)
    with pytest.raises(ValueError, match="buffer_length"):
        OverlongConfig(enable=True, max_response_length=100, buffer_length=0)


def test_score_items_adds_overlong_penalty_to_ok_items():
    register_scorer("test/overlong-raises", lambda s, g, e: 1 / 0, replace=True)
    overlong = OverlongConfig(enable=True, max_response_length=100, buffer_length=20, penalty_factor=1.0)
    items = [
        ScoreItem("openai/gsm8k", "#### 1", "1", response_length=40),
        ScoreItem("openai/gsm8k", "#### 1", "1", response_length=95),
        ScoreItem("openai/gsm8k", "#### 2", "1", response_length=100),
        ScoreItem("test/overlong-raises", "x", "1", response_length=100),
    ]
    results = score_items(items, ScoringConfig(overlong=overlong))
    assert [r.score for r in results] == pytest.approx([1.0, 0.25, -1.0, 0.0])
    assert [r.metrics.get("overlong") for r in results] == [0.0, 1.0, 1.0, None]
    assert results[1].metrics["overlong_reward"] == pytest.approx(-0.75)
    assert results[3].status == STATUS_ERROR
