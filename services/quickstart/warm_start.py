"""The quickstart model: the tiny model plus a quarter of a minute of supervised warm start.

    rlfabric make-tiny-model --warm-start            # what `rlfabric up` uses when model.path is empty (cached)

The warm start teaches the reply format, not the task. It trains on
rlfabric.reward.find_vowel.make_warm_start_example ("any letter of: - K - - E -", up to six letters
with no dashes) with every shown letter as a target, and never sees a task prompt, so the model
learns to answer with one letter copied from the prompt and then end its turn, with no preference
for vowels: on the task ("find the vowel") it scores about 1 in 6 until reinforcement learning finds
out that the vowel is what scores.

What makes the minutes-long RL run possible (and reliable) on CPU:
- The weights start wider than Qwen2's default (initializer_range 0.1 instead of 0.02). At 0.02 the
  64-wide model's attention is flat and needs hundreds of steps to start copying from the prompt;
  at 0.2 some seeds never learn to copy six letters cleanly (they spread mass over absent letters).
- A model that has learned to copy needs only a preference (vowels over consonants) from RL, which
  policy gradients find in tens of steps; learning to read the prompt from rewards alone takes far more.
- The copy is even: every letter of a six-letter prompt gets about the same chance. Prompts of up to
  six letters (the task's length), every shown letter as a target (the loss is the cross-entropy to
  the uniform choice, with no sampling noise) and a learning rate that decays to 0 leave no letter
  favoured or shunned. A model that (by chance) almost never copies, say, "E" gives RL nothing to
  reward on E prompts: it then settles on answering another vowel there and plateaus near 0.8.

Deterministic: fixed seeds and one CPU thread while training, so the same seed gives the same weights.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfabric.quickstart.tiny_model import make_tiny_model
from rlfabric.reward import find_vowel

QUICKSTART_INIT_RANGE = 0.1


@dataclass
class WarmStartResult:
    path: Path
    loss: float  # mean loss of the last step (answer letter and end-of-turn tokens)
    seconds: float


@contextlib.contextmanager
def _one_thread():
    """Single-threaded CPU kernels: reproducible sums, and the tiny model gains nothing from more."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompt + answer ids, labels only on the answer, positions counting real tokens."""
    width = max(len(prompt) + len(answer) for prompt, answer in examples)
    ids, labels, mask = [], [], []
    for prompt, answer in examples:
        pad = width - len(prompt) - len(answer)
        ids.append([pad_id] * pad + prompt + answer)
        labels.append([-100] * (pad + len(prompt)) + answer)
        mask.append([0] * pad + [1] * (len(prompt) + len(answer)))
    attention_mask = torch.tensor(mask)  # [B, S]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)}


def warm_start(model_dir: str | Path, steps: int = 400, batch_size: int = 16, lr: float = 3e-3,
               seed: int = 0) -> WarmStartResult:
    """Fine-tunes the model in model_dir in place on the warm-start examples (see the module docstring):
    `batch_size` prompts per step, each once per right answer; the learning rate decays linearly to 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(seed)
    prompt_ids: dict[str, list[int]] = {}  # short prompts repeat often: render each once

    def encode(prompt: str, answer: str) -> tuple[list[int], list[int]]:
        if prompt not in prompt_ids:
            prompt_ids[prompt] = list(tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False))
        return prompt_ids[prompt], tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]

    def next_batch() -> dict[str, torch.Tensor]:
        examples = [find_vowel.make_warm_start_example(rng) for _ in range(batch_size)]
        return _collate([encode(prompt, answer) for prompt, answers in examples for answer in answers],
                        tokenizer.pad_token_id)

    loss = fine_tune(model, next_batch, steps, lr, seed)
    model.save_pretrained(model_dir)
    return WarmStartResult(model_dir, loss, time.perf_counter() - started)


def fine_tune(model, next_batch: Callable[[], dict[str, torch.Tensor]], steps: int, lr: float, seed: int) -> float:
    """`steps` AdamW steps on next_batch()'s labelled batches, the learning rate decaying linearly to 0, on
    one thread and a forked torch RNG; returns the last loss and leaves the model in eval mode."""
    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        model.train()
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr * (1 - step / steps)
            loss = model(**next_batch(), use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()
    return loss.item()


def make_quickstart_model(out_dir: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """The tiny model (moe: the tiny Qwen3-MoE) with the quickstart's wider initialisation, warm-started;
    returns its path."""
    make_tiny_model(out_dir, initializer_range=QUICKSTART_INIT_RANGE, seed=seed, moe=moe)
    return warm_start(out_dir, seed=seed).path
