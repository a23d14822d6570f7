"""Input checks shared by the algorithm functions; each raises ValueError naming the caller."""

import torch


def check_same_shape(fn: str, name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise if `x` and `ref` differ in shape, e.g. "policy_loss: mask shape (2, 3) does not match ..."."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(
            f"{fn}: {name} shape {tuple(x.shape)} does not match {ref_name} shape {tuple(ref.shape)}"
        )


def check_2d(fn: str, name: str, x: torch.Tensor) -> None:
    """Raise unless `x` is a [batch, response_len] tensor."""
    if x.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2-D [batch, response_len], got shape {tuple(x.shape)}")


def check_per_row(fn: str, name: str, x: torch.Tensor, batch: int) -> None:
    """Raise unless `x` is a 1-D tensor with one entry per row of the batch."""
    if x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(f"{fn}: {name} must have shape ({batch},), got {tuple(x.shape)}")


def unknown_name(fn: str, what: str, name: str, known) -> ValueError:
    """The error for a name that is not one of `known` (lists the known names)."""
    return ValueError(f"{fn}: unknown {what} {name!r}; known: {', '.join(sorted(known))}")


def check_group_ids(fn: str, group_ids: torch.Tensor, batch: int) -> None:
    """Raise unless `group_ids` is an integer tensor [batch] (same id = same prompt)."""
    if not isinstance(group_ids, torch.Tensor) or group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"{fn}: group_ids must be an integer tensor [batch] (same id = same prompt)")
    check_per_row(fn, "group_ids", group_ids, batch)
