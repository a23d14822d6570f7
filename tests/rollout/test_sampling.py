"""The hf engine's per-row sampling: filters, log-probs, and independence from the other rows."""

from __future__ import annotations

import torch

from rlfabric.rollout.sampling import filter_mask, sample_tokens
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
    tokens, _ = sample_tokens(logits, *rows(20000), torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    frequencies = torch.bincount(tokens, minlength=3).float() / 20000
    torch.testing.assert_close(frequencies, torch.tensor([0.0, 1.0, 2.0]).softmax(-1), atol=0.015, rtol=0)


def test_row_seeds_and_stop_strings():
    assert row_seed(1, 0, 0) == row_seed(1, 0, 0) != row_seed(1, 0, 1) != row_seed(2, 0, 0)
    assert row_seed(None, 0, 0) != row_seed(None, 0, 0)
    assert truncate_at_stop("abc END def STOP", ["STOP", "END"]) == ("abc ", True)
    assert truncate_at_stop("abc", ["x"]) == ("abc", False)
