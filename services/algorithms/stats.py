"""Masked statistics over [batch, response_len] tensors, and per-group (per-prompt) indexing.

`mask` is the response mask: 1 (or True) for real response tokens, 0 for padding.
"""

import torch

from ._checks import check_same_shape

EPS = 1e-8


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / (sum(mask) + 1e-8), over all elements or along `dim`.

    An all-zero mask gives 0 (the 1e-8 keeps it finite), as in VeRL.
    """
    check_same_shape("masked_mean", "mask", mask, "x", x)
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / (mask.sum() + EPS)
    return (x * mask).sum(dim=dim) / (mask.sum(dim=dim) + EPS)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements; unbiased multiplies by N/(N-1), N = sum(mask).

    Raises ValueError when N is 0, or 1 with `unbiased` (a Python-side check, so one device sync).
    """
    check_same_shape("masked_var", "mask", mask, "x", x)
    n = float(mask.sum())
    if n == 0 or (unbiased and n == 1):
        raise ValueError(f"masked_var: mask has {n:g} valid elements; need at least {2 if unbiased else 1}")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) * rsqrt(var + 1e-8) with masked mean and unbiased variance.

    With shift_mean=False the mean is added back (only the scale changes).
    Needs at least 2 valid elements (ValueError otherwise).
    """
    check_same_shape("masked_whiten", "mask", mask, "x", x)
    n = float(mask.sum())
    if n < 2:
        raise ValueError(f"masked_whiten: mask has {n:g} valid elements; need at least 2")
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map arbitrary int ids to 0..G-1.

    Returns (inverse [batch] with each row's group number, counts [G] with each group's size).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def group_sum(x: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Sum of the 1-D tensor `x` within each group -> [n_groups]."""
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def group_reduce(x: torch.Tensor, inverse: torch.Tensor, n_groups: int, reduce: str) -> torch.Tensor:
    """`reduce` ("amax", "amin") of the 1-D tensor `x` within each group -> [n_groups]; every group has a
    member (group_index's numbering)."""
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).scatter_reduce(0, inverse, x, reduce,
                                                                               include_self=False)
