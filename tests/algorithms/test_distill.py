"""On-policy distillation's per-token signal (rlfabric.algorithms.distill) on numbers worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlfabric import algorithms as algos


def test_each_token_gets_minus_the_weighted_reverse_kl_of_its_own_and_padding_gets_nothing():
    student = torch.tensor([[math.log(0.5), math.log(0.25), 0.0],
                            [math.log(0.1), math.log(0.8), math.log(0.3)]])
    teacher = torch.tensor([[math.log(0.9), math.log(0.25), -7.0],
                            [math.log(0.01), math.log(0.4), math.log(0.3)]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])

    advantages, metrics = algos.distill_advantages(student, teacher, mask, weight=2.0)

    # -2 * (log p_s - log p_t) = 2 log(p_t / p_s), token by token: no discount, no baseline.
    expected = torch.tensor([[2 * math.log(0.9 / 0.5), 0.0, 0.0],
                             [2 * math.log(0.01 / 0.1), 2 * math.log(0.4 / 0.8), 0.0]])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)
    reverse_kls = [math.log(0.5 / 0.9), 0.0, math.log(0.1 / 0.01), math.log(0.8 / 0.4), 0.0]
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(reverse_kls) / 5, abs=1e-6)
    teacher_logprobs = [math.log(0.9), math.log(0.25), math.log(0.01), math.log(0.4), math.log(0.3)]
    assert metrics["distill/teacher_logprob"] == pytest.approx(sum(teacher_logprobs) / 5, abs=1e-6)


def test_a_student_equal_to_its_teacher_gets_no_push():
    log_probs = torch.log(torch.rand(4, 5) * 0.9 + 0.05)
    advantages, metrics = algos.distill_advantages(log_probs, log_probs.clone(), torch.ones(4, 5))
    assert advantages.abs().max() == 0 and metrics["distill/reverse_kl"] == 0


def test_shapes_that_differ_are_refused_by_name():
    with pytest.raises(ValueError, match="teacher_log_probs"):
        algos.distill_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
