"""The item and result types shared by every scorer (rule-based, custom function, reward model)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

STATUS_OK = "ok"
STATUS_ERROR = "error"  # the scorer raised (MemoryError included); score is 0
STATUS_TIMEOUT = "timeout"  # the scorer ran past its time limit; score is 0
STATUS_CRASHED = "crashed"  # the scorer's worker process died; score is 0

MAX_MESSAGE_CHARS = 300


@dataclass(slots=True)
class ScoreItem:
    """One response to score, as the reward service receives it."""

    data_source: str
    """Selects the scorer, as VeRL's data_source (e.g. "openai/gsm8k")."""
    response: str
    """The response text (VeRL's solution_str)."""
    ground_truth: Any
    """reward_model.ground_truth of the data row (a string for the built-in scorers)."""
    extra_info: dict[str, Any] | None = None
    """extra_info of the data row (JSON-compatible values when a custom function scores it)."""
    prompt: str = ""
    """The prompt text; a reward model reads it as one user turn when prompt_messages is empty."""
    response_length: int = 0
    """Response length in tokens, for the overlong penalty."""
    response_token_ids: Sequence[int] = ()
    """The response as token ids; the reward service decodes them when response is empty."""
    prompt_messages: Sequence[dict[str, str]] = ()
    """The conversation before the response ({"role", "content"} dicts); a reward model renders it and the
    response with its own chat template. Empty = prompt is the conversation."""


@dataclass(slots=True)
class ItemResult:
    """The score of one item: reward, how scoring went, and the scorer's extra numeric outputs."""

    score: float
    status: str = STATUS_OK
    """One of "ok", "error", "timeout", "crashed"; score is 0 unless "ok"."""
    message: str = ""
    """What went wrong (short), or a note such as "default score used"."""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


def failed(status: str, message: str) -> ItemResult:
    """A zero-score result with a non-ok status and a message cut to a few hundred characters."""
    return ItemResult(score=0.0, status=status, message=short_message(message))


def short_message(message: str) -> str:
    """Cut a message to MAX_MESSAGE_CHARS, keeping its start."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."


def describe_exception(exc: BaseException) -> str:
    """'TypeName: message' for an exception, cut short."""
    text = str(exc)
    return short_message(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def json_default(value: Any) -> Any:
    """json.dumps' `default` for an item's extra_info: numpy arrays and scalars (from a parquet row) as lists
    and numbers; TypeError for anything else."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def result_from_value(value: Any) -> ItemResult:
    """Turn what a scorer returned into an ItemResult, as VeRL reads a compute_score result.

    A dict's "score" is the reward and its other numeric values (bools included) become metrics;
    a number is the reward; a list or tuple's first element is the reward. A missing "score",
    a non-number or a non-finite score gives status "error" (VeRL would pass a NaN on).
    """
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return failed(STATUS_ERROR, f"the scorer returned a dict without a 'score' key: {sorted(value)}")
        for key, metric in value.items():
            if key != "score" and isinstance(metric, numbers.Real):
                metrics[str(key)] = float(metric)
        value = value["score"]
    elif isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, (str, bytes)):
        return failed(STATUS_ERROR, f"the scorer returned {type(value).__name__}, not a number")
    try:
        score = float(value)
    except (TypeError, ValueError):
        return failed(STATUS_ERROR, f"the scorer returned {type(value).__name__}, not a number")
    if not math.isfinite(score):
        return failed(STATUS_ERROR, f"the scorer returned a non-finite score ({score})")
    return ItemResult(score=score, metrics=metrics)
