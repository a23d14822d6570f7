"""The tolerances of the equivalence tests, derived once from what the two computations can promise.

The tests compare two ways of computing the same thing: one rank against FSDP2 or tensor-parallel ranks, padded
rows against packed ones, one forward per row against a shared prompt's one pass, the service against a plain
transformers forward. The two sides differ only in the order of their floating-point sums (a sharded matmul, an
all-reduce, another blocking of a kernel). How far apart that leaves them depends on the precision and on the
CPU's kernels (ATEN_CPU_CAPABILITY default, avx2 and avx512 sum in other orders), so a bound tuned in float32 on
one CPU fails on another. AdamW divides each gradient element by its own scale, so an element whose gradient
nearly cancels carries its rounding error into a whole step: in float32, lr 1e-3, two updates of two
mini-batches, the tensor-parallel actor's weights ended 1.4e-6 apart with avx2 kernels, 5.4e-6 with avx512 and
4.5e-6 with none (up to 1.35e-3 of lr * steps), while a wrong layout moves them by ~lr.

So these tests run the trainer in float64 (model.dtype float64), where a sum of K terms is exact to K * 2^-53 of
its terms' magnitudes: ~1e-12 for the K <= 10^4 of these models, in any order. One float32 computation is left:
transformers computes the rotary embedding's cos and sin in float32 whatever the model's dtype, and a layout that
changes their tensor's shape can round an angle's cosine one float32 step (ROTARY_STEP = 2^-24 relative)
differently (a vectorised loop body against its scalar tail). The bounds follow:

- LAYOUT_RTOL = ROTARY_STEP * 2^8 for what the layers compute from those angles, relative to its scale: metrics,
  gradients (to the largest element) and weights after AdamW steps (to lr * steps, as AdamW's step is homogeneous
  in the gradient: a relative error r in an element changes its step by ~3r). 2^8 is the allowance for the
  layers' gain and for how much a gradient element cancels (the sum of its terms' magnitudes over its magnitude).
  A fault (a shard's gradient dropped or counted twice, a row in another micro-batch, a wrong scale in a metric)
  changes what it touches by O(1) of that scale: 6e4 times the bound. (A uniform scale of every gradient leaves
  AdamW's weights alone: the grad_norm metric catches it.)
- FLOAT32_RTOL = 2^-21 for log-probs and values, which travel as float32: the rounding to float32 (at most 2^-23
  relative) plus the rotary step carried through the layers (2^-24 times a gain of up to 4, so 2^-22); with
  LOGPROB_ATOL = 2^-24, a float32 step at magnitude 1, for values so near 0 that a relative bound says nothing.

Two engines of the same weights (vLLM's CPU kernels or the hf engine against the actor) stay in float32: vLLM
serves no float64. Each rounds a log-prob's terms to float32, so they end a number of float32 steps apart at the
log-prob's magnitude: engine_logprob_gap(m) = the float32 step at |log p| < m, times the same 2^8 allowance, is
the bound on the largest |rollout log-prob - actor log-prob| over sampled tokens. For the tiny models |log p| of a
sampled token is below 16 (uniform over their vocabulary of 100 is 4.6): ENGINE_LOGPROB_GAP = 2^-20 * 2^8 =
2^-12. Measured under default, avx2 and avx512 (vLLM, whose kernels are compiled for the host, only under the
host's avx512: tests/kernel_families.py): 9.5e-7, two float32 steps; a replica that missed a sync is 0.146 or more away, 600 times the bound; a
bfloat16 replica 3.1e-3. SmolLM2 (vocabulary 49,152: uniform is 10.8) samples at |log p| < 32: 2^-11 = 4.9e-4,
measured 6.7e-5 with vLLM (2.7e-5 with its LoRA path).

Measured on this machine's three kernel families (the largest of default, avx2 and avx512, as a fraction of the
bound): weights 4e-7 (4.4e-13 of lr * steps one rank against two, 5.6e-12 against TP 2), gradients 5e-3
(7.9e-8 of the largest, a shared prompt's one pass against one per row), metrics 1.3e-4 (2.0e-9), log-probs 0.25
(one float32 step apart at most).
"""

from __future__ import annotations

import torch

FLOAT64 = {"dtype": "float64"}  # the model section of a float64 trainer
UNIT_ROUNDOFF = 2.0**-24  # float32: a step below magnitude m is at most m * UNIT_ROUNDOFF
ALLOWANCE = 2**8  # for the layers' gain and for how much a gradient element cancels
ROTARY_STEP = UNIT_ROUNDOFF
LAYOUT_RTOL = ROTARY_STEP * ALLOWANCE
FLOAT32_RTOL = 2.0**-21
LOGPROB_ATOL = UNIT_ROUNDOFF  # a float32 step at magnitude 1


def engine_logprob_gap(largest_abs_log_prob: float) -> float:
    """The bound on |log p| differences of two float32 engines of the same weights, for sampled log-probs of
    magnitude below `largest_abs_log_prob`: a float32 step there, times the allowance."""
    return largest_abs_log_prob * UNIT_ROUNDOFF * ALLOWANCE


ENGINE_LOGPROB_GAP = engine_logprob_gap(16.0)  # the tiny models': 2^-12


def _named(name: str):
    return lambda message: f"{name}: {message}" if name else message


def assert_same_float32(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Log-probs or values of two float64 computations, rounded to float32 (the wire) or left in float64."""
    torch.testing.assert_close(actual.double(), expected.double(), atol=LOGPROB_ATOL, rtol=FLOAT32_RTOL,
                               msg=_named(name))


def assert_same_update(actual: torch.Tensor, expected: torch.Tensor, lr: float, steps: int, name: str = "") -> None:
    """Float64 weights after `steps` AdamW steps of learning rate lr from the same start, in two layouts."""
    assert actual.dtype == expected.dtype == torch.float64, (name, actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, atol=lr * steps * LAYOUT_RTOL, rtol=0, msg=_named(name))


def assert_same_gradient(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Float64 gradients of the same loss in two layouts."""
    assert actual.dtype == expected.dtype == torch.float64, (name, actual.dtype, expected.dtype)
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, atol=scale * LAYOUT_RTOL, rtol=0, msg=_named(name))


def assert_same_metric(actual: float, expected: float, name: str = "") -> None:
    """A metric of a float64 trainer computed in two layouts."""
    assert abs(actual - expected) <= LAYOUT_RTOL * max(1.0, abs(expected)), (name, actual, expected)
