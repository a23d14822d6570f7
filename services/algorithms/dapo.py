"""DAPO pieces (Yu et al. 2025): dynamic sampling (filter_groups). DAPO's overlong reward shaping is the reward
service's (rlfabric.reward.overlong), where the response lengths are."""

import torch

from ._checks import check_group_ids
from .stats import group_index


def filter_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling: keep-mask [batch] (bool) that drops every group whose scores are all equal.

    Such groups (all right or all wrong) get zero GRPO advantage and so no gradient. As in VeRL, a group
    of one response is kept. Equality is exact (max == min), so float noise in a mean cannot keep a
    degenerate group.
    """
    if scores.dim() != 1:
        raise ValueError(f"filter_groups: scores must be 1-D [batch], got shape {tuple(scores.shape)}")
    check_group_ids("filter_groups", group_ids, scores.shape[0])
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    inverse, counts = group_index(group_ids)  # [batch], [groups]
    n_groups = counts.numel()
    group_max = scores.new_full((n_groups,), float("-inf")).scatter_reduce(0, inverse, scores, "amax")
    group_min = scores.new_full((n_groups,), float("inf")).scatter_reduce(0, inverse, scores, "amin")
    keep_group = (group_max > group_min) | (counts == 1)  # [groups]
    return keep_group[inverse]

