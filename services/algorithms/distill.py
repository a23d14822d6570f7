"""On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines' "On-Policy Distillation", 2025): the
student samples, the teacher scores each sampled token, and the per-token reverse KL is the signal.

    reverse_kl_t = log pi_student(y_t) - log pi_teacher(y_t)       (a one-sample estimate of KL(student || teacher))
    A_t          = -weight * reverse_kl_t                          (no discount: each token's own)

The advantage then goes through the usual importance-weighted policy gradient (PPO's clipped ratio), as
Tinker's cookbook trains it. Tokens the teacher finds likelier than the student are pushed up, the others
down; a student equal to the teacher gets no push.
"""

import torch

from ._checks import check_2d, check_same_shape
from .stats import masked_mean


def distill_advantages(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor,
                       weight: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages -weight * (log_probs - teacher_log_probs) [B, T], 0 off the mask, and the metrics
    distill/reverse_kl (the masked mean of the reverse KL) and distill/teacher_logprob (of the teacher's).

    log_probs: the student's log-probs of its sampled tokens (the old policy's); teacher_log_probs: the
    teacher's of the same tokens; mask: 1 on the response tokens trained on."""
    check_2d("distill_advantages", "log_probs", log_probs)
    check_same_shape("distill_advantages", "teacher_log_probs", teacher_log_probs, "log_probs", log_probs)
    check_same_shape("distill_advantages", "mask", mask, "log_probs", log_probs)
    reverse_kl = (log_probs - teacher_log_probs) * mask  # [B, T]
    metrics = {"distill/reverse_kl": float(masked_mean(reverse_kl, mask)),
               "distill/teacher_logprob": float(masked_mean(teacher_log_probs, mask))}
    return -weight * reverse_kl, metrics
