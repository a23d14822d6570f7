"""Rule-based scorers keyed by data_source.

A scorer is a plain function called as ``fn(solution_str, ground_truth, extra_info, **kwargs)``
returning a float (or a dict with a "score" key). ``kwargs`` are the reward config's
compute_score_kwargs (e.g. ``method="flexible"`` for GSM8K); a scorer that takes none may omit them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rlfabric.reward import arithmetic, find_vowel, gsm8k, hellaswag, math_equiv

Scorer = Callable[..., Any]

# rlfabric/lookup (rlfabric.env.lookup): its answer is "#### D" too, scored as its environment scores it, so an
# agent trained through the gateway (agent.entrypoint) may return its answer for the reward service to score.
GSM8K_DATA_SOURCES = ("openai/gsm8k", "rlfabric/lookup")
# VeRL sends these to its Hendrycks-style math.py; other math sources it knows ("math_dapo", "aime*",
# "numina_*") use different scorers (math_dapo, prime_math) that are not part of rlfabric.
MATH_DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


# Data sources whose scorers an optional extra's module registers when it is imported, on the first lookup of
# one of them (its library costs seconds to import): prefix -> (module, the extra that installs its library).
SCORER_FAMILIES = {"reasoning_gym/": ("rlfabric.reward.reasoning_gym", "reasoning-gym")}


class UnknownDataSourceError(NotImplementedError):
    """No scorer is registered for a data_source (a NotImplementedError, as VeRL raises)."""

    def __init__(self, data_source: str, reason: str = ""):
        super().__init__(
            f"Reward function is not implemented for data_source={data_source!r}; "
            + (reason or f"registered: {', '.join(registered_data_sources())}")
        )
        self.data_source = data_source


_SCORERS: dict[str, Scorer] = {}


def register_scorer(data_source: str, fn: Scorer, replace: bool = False) -> None:
    """Score items of data_source with fn; registering a taken name needs replace=True."""
    if not callable(fn):
        raise TypeError(f"scorer for {data_source!r} must be callable, got {type(fn).__name__}")
    if data_source in _SCORERS and not replace:
        raise ValueError(
            f"a scorer for data_source {data_source!r} is already registered (pass replace=True)"
        )
    _SCORERS[data_source] = fn


def load_scorer_modules(modules: list[str]) -> None:
    """Imports each of reward.scorer_modules, so its register_scorer calls run (again: a no-op); ConfigError
    naming the key and the module when one cannot be imported."""
    # Imported here: the sandboxed scorer imports this package, and the config's models (pydantic) would
    # double its address space, which RLIMIT_AS (reward.custom_sandbox) counts against the user's function.
    from rlfabric.core.config import import_named_modules

    import_named_modules("reward.scorer_modules", modules)


def get_scorer(data_source: str) -> Scorer:
    """The scorer registered for data_source (a SCORER_FAMILIES module is imported for it first); an
    UnknownDataSourceError if there is none."""
    if data_source not in _SCORERS:
        _load_family(data_source)
    try:
        return _SCORERS[data_source]
    except KeyError:
        raise UnknownDataSourceError(data_source) from None


def has_scorer(data_source: str) -> bool:
    """Whether get_scorer(data_source) finds a scorer."""
    try:
        get_scorer(data_source)
    except UnknownDataSourceError:
        return False
    return True


def _load_family(data_source: str) -> None:
    """Imports the module that registers data_source's family, if it has one; UnknownDataSourceError naming the
    extra when its library is not installed."""
    for prefix, (module, extra) in SCORER_FAMILIES.items():
        if data_source.startswith(prefix):
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as error:
                raise UnknownDataSourceError(data_source, f"its scorer needs {error.name}: pip install "
                                                          f"'rlfabric[{extra}]'") from None


def registered_data_sources() -> list[str]:
    """Every data_source with a scorer, sorted."""
    return sorted(_SCORERS)


def score_gsm8k(
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    **unused: Any,
) -> float:
    """GSM8K scorer in registry form (extra_info and unknown kwargs are ignored)."""
    return gsm8k.compute_score(
        solution_str, ground_truth, method=method, format_score=format_score, score=score
    )


def score_math(solution_str: str, ground_truth: str, extra_info: dict | None = None, **unused: Any) -> float:
    """MATH scorer in registry form (extra_info and kwargs are ignored)."""
    return math_equiv.compute_score(solution_str, ground_truth)


for _source in GSM8K_DATA_SOURCES:
    register_scorer(_source, score_gsm8k)
for _source in MATH_DATA_SOURCES:
    register_scorer(_source, score_math)
register_scorer(find_vowel.DATA_SOURCE, find_vowel.compute_score)
register_scorer(arithmetic.DATA_SOURCE, arithmetic.compute_score)
register_scorer(hellaswag.DATA_SOURCE, hellaswag.compute_score)
