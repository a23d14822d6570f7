"""Reward scoring: rule-based scorers (GSM8K, MATH) as VeRL scores them, a registry keyed by
data_source, reasoning-gym's own scorers (rlfabric.reward.reasoning_gym, imported on the first
reasoning_gym/* lookup), user functions in a sandboxed worker pool, the DAPO overlong penalty, and
(in rlfabric.reward.model_reward, which imports torch) reward models.

    from rlfabric.reward import ScoreItem, score_items
    results = score_items([ScoreItem("openai/gsm8k", "... #### 72", "72")])
"""

from rlfabric.reward.custom import CustomFunctionLoadError, CustomScorerPool
from rlfabric.reward.items import (
    STATUS_CRASHED,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    ItemResult,
    ScoreItem,
)
from rlfabric.reward.overlong import OverlongConfig, apply_overlong_penalty, overlong_penalty
from rlfabric.reward.registry import (
    UnknownDataSourceError,
    get_scorer,
    register_scorer,
    registered_data_sources,
)
from rlfabric.reward.scoring import (
    ScoringConfig,
    add_overlong_penalty,
    compute_score,
    default_compute_score,
    score_items,
)

__all__ = [
    "STATUS_CRASHED",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_TIMEOUT",
    "CustomFunctionLoadError",
    "CustomScorerPool",
    "ItemResult",
    "OverlongConfig",
    "ScoreItem",
    "ScoringConfig",
    "UnknownDataSourceError",
    "add_overlong_penalty",
    "apply_overlong_penalty",
    "compute_score",
    "default_compute_score",
    "get_scorer",
    "overlong_penalty",
    "register_scorer",
    "registered_data_sources",
    "score_items",
]
