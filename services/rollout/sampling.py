"""Token sampling for the hf engine: per-row temperature, top-k, top-p and random stream.

Every row samples by inverse CDF over its filtered distribution in vocabulary order, with one uniform
number per token that depends only on (row seed, token position): `counter_uniforms` computes it on the
device. So a row's tokens depend only on its own logits and seed, never on the other rows of the batch,
and a row needs no random state of its own: a row resumed after a weight swap goes on at its position.

The returned log-prob is that of the sampling distribution: log_softmax of logits / T with the
tokens top-k/top-p removed set to -inf (vLLM's "processed_logprobs"). Without filtering
(top_p = 1, top_k off) that is exactly the actor's log_softmax(logits / T). Greedy rows (T = 0)
use T = 1.
"""

from __future__ import annotations

import torch

# SplitMix64's constants (Steele, Lea, Flood 2014; the seeding generator of java.util.SplittableRandom and
# xoshiro), as the signed int64 values of the same bits.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> on int64 is arithmetic: it copies the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1), float64: element [b, t] is a function of (seeds[b], positions[b, t]) alone.

    seeds: (B,) int64 row seeds; positions: (B, T) int64 token positions. The number is SplitMix64's
    output number positions + 1 of the stream seeded with the row seed (its top 53 bits), computed at once
    for any position with integer ops on the seeds' device: no generator object per row, and no host
    work or host-to-device copy per token. Hand-written because torch has no counter-based generator
    keyed per element (torch.Generator is one stream per object, and its Philox offset is global).
    int64 multiplication wraps modulo 2**64 on every torch backend, which is the arithmetic SplitMix64 uses.
    """
    state = seeds[:, None] + (positions + 1) * _GOLDEN_GAMMA  # (B, T)
    state = (state ^ _shift_right(state, 30)) * _MIX_1
    state = (state ^ _shift_right(state, 27)) * _MIX_2
    state = state ^ _shift_right(state, 31)
    return _shift_right(state, 11).double() * 2.0**-53


def filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                filters: bool | None = None) -> torch.Tensor | None:
    """Boolean mask (B, V) of tokens that top-k / top-p remove; None when no row filters.

    scaled: (B, V) logits / T; top_k: (B,) int, <= 0 off; top_p: (B,) float in (0, 1]. filters: whether
    some row filters, when the caller knows (None: read from top_k and top_p, a host sync on a GPU).
    """
    filters_k = top_k > 0
    if filters is None:
        filters = bool(filters_k.any() or (top_p < 1).any())
    if not filters:
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
    filters: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob, with no host sync when `filters` is given.

    logits: (B, V) float; temperature: (B,) with 0 = greedy; top_k: (B,) int; top_p: (B,);
    uniforms: (B,) float64 in [0, 1), the row's number for this token (counter_uniforms);
    filters: whether some non-greedy row uses top-k or top-p (None: read from the tensors).
    Returns tokens (B,) int64 and logprobs (B,) float32.
    """
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    top_k = torch.where(greedy, -1, top_k)  # greedy ignores top-k/top-p, as vLLM does
    top_p = torch.where(greedy, 1.0, top_p)
    scaled = logits / scale[:, None]  # (B, V)
    removed = filter_mask(scaled, top_k, top_p, filters)
    if removed is not None:
        scaled = scaled.masked_fill(removed, float("-inf"))
    logprobs = scaled.log_softmax(dim=-1)  # (B, V) the sampling distribution
    weights = logprobs.exp().double()
    cdf = weights.cumsum(dim=-1)  # (B, V)
    target = uniforms.double() * cdf[:, -1]
    sampled = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
