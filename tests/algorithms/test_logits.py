"""log_probs_and_entropy against the naive full-vocabulary computation: values and gradients, for any
temperature, dtype, block size and window; and what it keeps for the backward pass."""

from __future__ import annotations

import pytest
import torch

from rlfabric import algorithms as algos


def naive(logits: torch.Tensor, labels: torch.Tensor, temperature: float, start: int):
    """log_softmax over the whole upcast window, as the textbook (and VeRL) writes it."""
    window = logits[:, start : start + labels.shape[1]]
    log_p = torch.log_softmax(window.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def value_and_grads(fn, logits, labels, weights):
    """fn's outputs and d(sum w1 * log_prob + w2 * entropy)/dlogits."""
    leaf = logits.detach().clone().requires_grad_()
    log_probs, entropy = fn(leaf, labels)
    ((log_probs * weights[0].to(log_probs.dtype)).sum() + (entropy * weights[1].to(entropy.dtype)).sum()).backward()
    return log_probs.detach(), entropy.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7])
def test_values_and_gradients_equal_the_naive_path(dtype, temperature, chunk_size):
    gen = torch.Generator().manual_seed(0)
    rows, length, vocab, response = 3, 7, 13, 4
    logits = (torch.randn(rows, length, vocab, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows, response), generator=gen)
    weights = torch.randn(2, rows, response, generator=gen, dtype=torch.float64)
    start = length - response - 1  # the actor's layout: the last position predicts nothing
    ours = value_and_grads(lambda x, y: algos.log_probs_and_entropy(x, y, temperature, True, start, chunk_size),
                           logits, labels, weights)
    theirs = value_and_grads(lambda x, y: naive(x, y, temperature, start), logits, labels, weights)
    for mine, expected in zip(ours, theirs, strict=True):
        assert mine.dtype == expected.dtype
        torch.testing.assert_close(mine, expected)
    assert (ours[2][:, start + response :] == 0).all()  # no gradient outside the window


def test_gradients_of_each_output_alone_and_gradcheck():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 6, (2, 4), generator=gen)
    for which in (0, 1):
        leaf = logits.clone().requires_grad_()
        algos.log_probs_and_entropy(leaf, labels, 0.8, True, start=0, chunk_size=3)[which].sum().backward()
        reference = logits.clone().requires_grad_()
        naive(reference, labels, 0.8, 0)[which].sum().backward()
        torch.testing.assert_close(leaf.grad, reference.grad)
    assert torch.autograd.gradcheck(
        lambda x: algos.log_probs_and_entropy(x, labels, 0.7, True, start=1, chunk_size=2),
        (logits.clone().requires_grad_(),))


def test_only_the_given_logits_are_kept_for_backward():
    """No float32 copy of the (bf16) logits survives the forward pass: the saved tensors are the logits
    themselves, the labels and per-token results."""
    logits = torch.randn(4, 9, 1000).bfloat16().requires_grad_()
    labels = torch.randint(0, 1000, (4, 8))
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        log_probs, entropy = algos.log_probs_and_entropy(logits, labels, 0.7, True, start=0, chunk_size=5)
    vocab_sized = [t for t in saved if t.shape[-1] == 1000]
    assert len(vocab_sized) == 1 and vocab_sized[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() for t in saved if t.shape[-1] != 1000) <= 3 * labels.numel()
    (log_probs.sum() + entropy.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.shape == logits.shape


def test_a_detached_entropy_sends_no_gradient():
    logits = torch.randn(2, 4, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (2, 4))
    log_probs, entropy = algos.log_probs_and_entropy(logits, labels)
    (log_probs.sum() + entropy.detach().sum()).backward()
    reference = logits.detach().clone().requires_grad_()
    naive(reference, labels, 1.0, 0)[0].sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad)


def test_without_entropy_and_under_no_grad():
    logits = torch.randn(2, 5, 9)
    labels = torch.randint(0, 9, (2, 3))
    with torch.no_grad():
        log_probs, entropy = algos.log_probs_and_entropy(logits, labels, 2.0, with_entropy=False)
    assert entropy is None
    torch.testing.assert_close(log_probs, naive(logits, labels, 2.0, 2)[0])


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match=r"positions 3\.\.6 are outside the 5 positions"):
        algos.log_probs_and_entropy(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long), start=3)
    with pytest.raises(ValueError, match=r"need logits \[B, L, vocab\] and labels \[B, T\]"):
        algos.log_probs_and_entropy(torch.zeros(5, 7), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature > 0"):
        algos.log_probs_and_entropy(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long), temperature=0.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_sum_pi_squared_equals_the_naive_softmax(dtype, chunk_size):
    logits = (3 * torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(5))).to(dtype)
    squares = algos.sum_pi_squared_from_logits(logits, 4, temperature=0.6, start=2, chunk_size=chunk_size)
    p = torch.softmax(logits[:, 2:6].to(torch.promote_types(dtype, torch.float32)) / 0.6, dim=-1)
    torch.testing.assert_close(squares, p.square().sum(-1), rtol=0, atol=1e-6)
    naive_log_probs = naive(logits, logits[:, 2:6].argmax(-1), 0.6, 2)[0]
    assert (squares >= naive_log_probs.exp() ** 2 - 1e-6).all() and (squares <= 1 + 1e-6).all()
    with pytest.raises(ValueError, match=r"positions 5\.\.8"):
        algos.sum_pi_squared_from_logits(logits, 4, start=5)
