"""KL penalty estimators (Schulman's k1/k2/k3 and friends), KL coefficient controllers, and the
KL-in-the-reward step.
"""

import torch

from ._checks import check_2d, check_same_shape, unknown_name
from .stats import masked_mean

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def _kl_value(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("k1", "kl"):
        return log_probs - ref_log_probs
    if kind == "abs":
        return (log_probs - ref_log_probs).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (log_probs - ref_log_probs).square()
    # k3: unbiased, always >= 0, low variance; clamps keep exp() and the value finite
    x = torch.clamp(ref_log_probs - log_probs, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1, min=-10.0, max=10.0)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from log-probs of the sampled tokens, same shape as the input.

    kind: "k1"/"kl" (d = logp - ref_logp), "abs" (|d|), "k2"/"mse" (d^2 / 2), "k3"/"low_var_kl".
    A "+" suffix ("k3+", "low_var_kl+", ...) keeps the named value in the forward pass but takes
    the gradient of k2 (straight-through): the k1 and k3 values estimate the KL, but their gradients
    do not estimate the KL's gradient; k2's does.
    """
    check_same_shape("kl_penalty", "ref_log_probs", ref_log_probs, "log_probs", log_probs)
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_KINDS:
        raise unknown_name("kl_penalty", "kind", kind, KL_KINDS + tuple(k + "+" for k in KL_KINDS))
    value = _kl_value(log_probs, ref_log_probs, base)
    if base == kind or base in ("k2", "mse"):
        return value
    k2 = 0.5 * (log_probs - ref_log_probs).square()
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """Constant KL coefficient beta."""

    def __init__(self, coef: float = 0.001):
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): beta grows when the measured KL is above
    `target`, shrinks when below, by at most 20% per `horizon` samples.
    """

    def __init__(self, init_coef: float, target: float = 0.1, horizon: int = 10000):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController: target and horizon must be > 0, got {target}, {horizon}")
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """beta *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def kl_in_reward(
    token_rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, float]:
    """Subtract the KL penalty from the per-token rewards, then update the controller.

    new_token_rewards = token_rewards - beta * kl * mask, with beta = kl_ctrl.value before the update.
    current_kl = mean over sequences of the per-sequence masked mean of kl; the controller is then
    updated with (current_kl, n_steps = batch size). `log_probs` are the rollout policy's (old) log-probs.
    Returns (new_token_rewards [batch, response_len], current_kl as a float).
    """
    fn = "kl_in_reward"
    check_2d(fn, "token_rewards", token_rewards)
    check_same_shape(fn, "log_probs", log_probs, "token_rewards", token_rewards)
    check_same_shape(fn, "ref_log_probs", ref_log_probs, "token_rewards", token_rewards)
    check_same_shape(fn, "mask", mask, "token_rewards", token_rewards)
    with torch.no_grad():
        mask = mask.to(token_rewards.dtype)
        kl = kl_penalty(log_probs, ref_log_probs, kind) * mask  # [batch, response_len]
        new_token_rewards = token_rewards - kl_ctrl.value * kl
        current_kl = masked_mean(kl, mask, dim=-1).mean().item()  # one device sync
    kl_ctrl.update(current_kl=current_kl, n_steps=token_rewards.shape[0])
    return new_token_rewards, current_kl
