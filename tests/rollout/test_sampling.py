"""The hf engine's per-row sampling: filters, log-probs, independence from the other rows, and the random
numbers keyed by (row seed, position)."""

from __future__ import annotations

import random

import torch
from torch.overrides import TorchFunctionMode

from rlfabric.rollout.sampling import counter_uniforms, filter_mask, sample_tokens
from rlfabric.rollout.types import row_seed, truncate_at_stop


def rows(batch: int, **values):
    defaults = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}
    defaults.update(values)
    return (torch.full((batch,), float(defaults["temperature"])), torch.full((batch,), int(defaults["top_k"])),
            torch.full((batch,), float(defaults["top_p"])))


def test_unfiltered_logprobs_are_log_softmax_of_logits_over_temperature():
    logits = torch.randn(4, 50)
    tokens, logprobs = sample_tokens(logits, *rows(4, temperature=0.7), torch.rand(4, dtype=torch.float64))
    expected = (logits / 0.7).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)


def test_filters_remove_tokens_and_renormalise():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert filter_mask(logits, torch.tensor([2]), torch.tensor([1.0])).tolist() == [[False, False, True, True]]
    # top_p 0.6: the first token holds ~0.64 of the mass, so it alone stays.
    assert filter_mask(logits, torch.tensor([-1]), torch.tensor([0.6])).tolist() == [[False, True, True, True]]
    assert filter_mask(logits, torch.tensor([-1]), torch.tensor([1.0])) is None
    tokens, logprobs = sample_tokens(logits.expand(100, 4), *rows(100, top_k=2), torch.rand(100, dtype=torch.float64))
    assert set(tokens.tolist()) <= {0, 1}
    expected = torch.tensor([3.0, 2.0]).log_softmax(-1)
    torch.testing.assert_close(logprobs, expected[tokens])


def test_greedy_rows_ignore_filters_and_use_temperature_one():
    logits = torch.randn(3, 20)
    tokens, logprobs = sample_tokens(logits, *rows(3, temperature=0.0, top_k=1, top_p=0.1), torch.rand(3, dtype=torch.float64))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).max(-1).values)


def test_a_row_does_not_depend_on_the_other_rows():
    logits = torch.randn(1, 64)
    uniform = torch.tensor([0.37], dtype=torch.float64)
    alone = sample_tokens(logits, *rows(1), uniform)
    others = torch.randn(3, 64)
    temperature, top_k, top_p = rows(4)
    top_k[1:], top_p[1:] = 5, 0.5  # the neighbours filter; the first row does not
    batched = sample_tokens(torch.cat([logits, others]), temperature, top_k, top_p, torch.cat([uniform, torch.rand(3, dtype=torch.float64)]))
    assert batched[0][0] == alone[0][0] and torch.isclose(batched[1][0], alone[1][0])


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, 3)
    uniforms = counter_uniforms(torch.arange(20000), torch.zeros(20000, 1, dtype=torch.int64))[:, 0]  # 20000 seeds
    tokens, _ = sample_tokens(logits, *rows(20000), uniforms)
    frequencies = torch.bincount(tokens, minlength=3).float() / 20000
    torch.testing.assert_close(frequencies, torch.tensor([0.0, 1.0, 2.0]).softmax(-1), atol=0.015, rtol=0)


def test_row_seeds_and_stop_strings():
    assert row_seed(1, 0, 0) == row_seed(1, 0, 0) != row_seed(1, 0, 1) != row_seed(2, 0, 0)
    assert row_seed(None, 0, 0) != row_seed(None, 0, 0)
    assert truncate_at_stop("abc END def STOP", ["STOP", "END"]) == ("abc ", True)
    assert truncate_at_stop("abc", ["x"]) == ("abc", False)


def splitmix64(seed: int, count: int) -> list[float]:
    """The first `count` numbers of SplitMix64 seeded with `seed`, as [0, 1) floats (the top 53 bits), in
    plain Python integers: the reference of counter_uniforms."""
    mask, state, numbers = (1 << 64) - 1, seed, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        numbers.append((z >> 11) * 2.0**-53)
    return numbers


def test_counter_uniforms_are_splitmix64_of_the_row_seed_at_each_position():
    seeds = [0, 1, 12345, 2**63 - 1, random.Random(0).getrandbits(63)]
    positions = torch.arange(40).expand(len(seeds), 40)
    assert counter_uniforms(torch.tensor(seeds), positions).tolist() == [splitmix64(seed, 40) for seed in seeds]
    # Any positions, in any order: a resumed row (partial rollouts) goes on where it was.
    later = counter_uniforms(torch.tensor(seeds[:1]), torch.tensor([[39, 7, 12]]))
    assert later.tolist() == [[splitmix64(seeds[0], 40)[i] for i in (39, 7, 12)]]


def test_counter_uniforms_are_uniform_and_uncorrelated():
    numbers = counter_uniforms(torch.arange(500), torch.arange(400).expand(500, 400))  # (seed, position)
    assert 0 <= numbers.min() and numbers.max() < 1
    counts = torch.histc(numbers.float(), bins=20, min=0, max=1)
    chi2 = ((counts - numbers.numel() / 20) ** 2 / (numbers.numel() / 20)).sum()
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 past 43.8
    for a, b in ((numbers[:, 1:], numbers[:, :-1]), (numbers[1:], numbers[:-1])):  # next position, next seed
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.01


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += getattr(func, "__name__", "") in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu")
        return func(*args, **(kwargs or {}))


def test_sampling_reads_nothing_back_when_the_caller_says_whether_rows_filter():
    """No host sync per token on a GPU: the engine decides on the host, once per batch, whether any row
    filters; only without that does sample_tokens read the filters back."""
    logits, uniforms = torch.randn(4, 50), counter_uniforms(torch.arange(4), torch.zeros(4, 1, dtype=torch.int64))[:, 0]
    for filters, top_k in ((False, -1), (True, 5)):
        with HostReads() as reads:
            sample_tokens(logits, *rows(4, top_k=top_k), uniforms, filters=filters)
        assert reads.reads == 0
    with HostReads() as reads:
        sample_tokens(logits, *rows(4), uniforms)
    assert reads.reads > 0
