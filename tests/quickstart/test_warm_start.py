"""The quickstart model's warm start: deterministic, teaches the reply format, leaves the task to RL."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfabric.quickstart.cached import cached_quickstart_model
from rlfabric.quickstart.tiny_model import make_tiny_model
from rlfabric.quickstart.warm_start import warm_start
from rlfabric.reward import find_vowel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quickstart():
    """(model, tokenizer) of the model `rlfabric up` uses when model.path is empty: the machine's cached
    make_quickstart_model (built here if the cache lacks it)."""
    path = cached_quickstart_model()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def task_prompts(tokenizer, count: int, seed: int = 123) -> list[tuple[list[int], list[str], str]]:
    """(prompt ids, the prompt's letters, answer) of task examples."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text, answer = find_vowel.make_example(rng)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        prompts.append((list(ids), text.removeprefix(find_vowel.INSTRUCTION).split(" "), answer))
    return prompts


def next_token_probs(model, prompts) -> torch.Tensor:
    """[prompts, vocab]: the model's next-token distribution after each prompt, in one forward pass (task
    prompts all have one length; torch.tensor refuses ragged ones)."""
    return model(torch.tensor([ids for ids, _, _ in prompts])).logits[:, -1].softmax(-1)


def test_default_tiny_model_keeps_qwen2_init(tmp_path):
    config = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m")).config
    assert config.initializer_range == 0.02


def test_warm_start_is_deterministic(tmp_path):
    states = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        path = make_tiny_model(tmp_path / name, initializer_range=0.2)
        warm_start(path, steps=5, seed=seed)
        states.append(AutoModelForCausalLM.from_pretrained(path).state_dict())
    same, other_seed = states[1], states[2]
    assert all(torch.equal(states[0][k], same[k]) for k in states[0])
    assert not all(torch.equal(states[0][k], other_seed[k]) for k in states[0])


@torch.no_grad()
def test_greedy_replies_are_one_letter_of_the_prompt_then_end_of_turn(quickstart):
    model, tokenizer = quickstart
    prompts = task_prompts(tokenizer, 40)
    ids = torch.tensor([ids for ids, _, _ in prompts])  # one length: one batch, no padding
    replies = model.generate(ids, max_new_tokens=3, do_sample=False)[:, ids.shape[1]:].tolist()
    copied = 0
    for (_, letters, _), reply in zip(prompts, replies, strict=True):
        assert reply[1:2] == [tokenizer.eos_token_id], tokenizer.decode(reply)
        copied += tokenizer.decode(reply[:1]) in letters
    assert copied >= 0.9 * len(prompts)


@torch.no_grad()
def test_warm_started_model_does_not_solve_the_task(quickstart):
    """The expected first-step score is at most P(first token = answer): well below the quickstart's 0.3
    bar, while the model puts nearly all its mass on the prompt's letters (it copies, RL picks)."""
    model, tokenizer = quickstart
    p_answer, p_shown = [], []
    prompts = task_prompts(tokenizer, 300)
    for (_, letters, answer), probs in zip(prompts, next_token_probs(model, prompts), strict=True):
        token = {c: tokenizer.convert_tokens_to_ids(c) for c in letters}
        p_answer.append(float(probs[token[answer]]))
        p_shown.append(float(sum(probs[t] for t in token.values())))
    assert sum(p_answer) / len(p_answer) < 0.25
    assert sum(p_shown) / len(p_shown) > 0.9


@torch.no_grad()
def test_warm_started_model_copies_every_letter_evenly(quickstart):
    """Each letter of a task prompt gets about 1 in 6: a letter the model (by chance) almost never
    copies would leave RL nothing to reward on the prompts whose vowel it is."""
    model, tokenizer = quickstart
    copy_probability: dict[str, list[float]] = {}
    prompts = task_prompts(tokenizer, 300)
    for (_, letters, _), probs in zip(prompts, next_token_probs(model, prompts), strict=True):
        for letter in letters:
            copy_probability.setdefault(letter, []).append(float(probs[tokenizer.convert_tokens_to_ids(letter)]))
    means = {letter: sum(p) / len(p) for letter, p in copy_probability.items()}
    assert set(means) == set(find_vowel.LETTERS)
    assert all(1 / 12 < p < 1 / 3 for p in means.values()), means
