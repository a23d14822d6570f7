"""Token sampling for the hf engine: per-row temperature, top-k, top-p and random stream.

Every row draws one uniform number per step from its own torch.Generator and samples by inverse
CDF over the filtered distribution in vocabulary order, so a row's tokens depend only on its own
logits and seed, never on the other rows of the batch.

The returned log-prob is that of the sampling distribution: log_softmax of logits / T with the
tokens top-k/top-p removed set to -inf (vLLM's "processed_logprobs"). Without filtering
(top_p = 1, top_k off) that is exactly the actor's log_softmax(logits / T). Greedy rows (T = 0)
use T = 1.
"""

from __future__ import annotations

import torch


def filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Boolean mask (B, V) of tokens that top-k / top-p remove; None when no row filters.

    scaled: (B, V) logits / T; top_k: (B,) int, <= 0 off; top_p: (B,) float in (0, 1].
    """
    filters_k = top_k > 0
    filters_p = top_p < 1
    if not bool(filters_k.any() or filters_p.any()):
        return None
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(vocab, device=scaled.device).expand_as(sorted_logits)
    k = torch.where(filters_k, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove_sorted = rank >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    remove_sorted |= mass_before >= top_p[:, None]
    remove_sorted[:, 0] = False  # the most likely token always stays
    return torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob.

    logits: (B, V) float; temperature: (B,) with 0 = greedy; top_k: (B,) int; top_p: (B,);
    uniforms: (B,) float64 in [0, 1), one draw per row from the row's generator.
    Returns tokens (B,) int64 and logprobs (B,) float32.
    """
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    top_k = torch.where(greedy, -1, top_k)  # greedy ignores top-k/top-p, as vLLM does
    top_p = torch.where(greedy, 1.0, top_p)
    scaled = logits / scale[:, None]  # (B, V)
    removed = filter_mask(scaled, top_k, top_p)
    if removed is not None:
        scaled = scaled.masked_fill(removed, float("-inf"))
    logprobs = scaled.log_softmax(dim=-1)  # (B, V) the sampling distribution
    weights = logprobs.exp().double()
    cdf = weights.cumsum(dim=-1)  # (B, V)
    target = uniforms.double() * cdf[:, -1]
    sampled = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
