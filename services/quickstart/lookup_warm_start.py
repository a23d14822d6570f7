"""A warm start for the multi-turn lookup task (rlfabric.env.lookup): the tiny model learns the Hermes
tool-call format and the shape of an episode on demonstrations.

    make_lookup_model(OUT)        # the tiny model, then ~1-2 minutes of supervised warm start on CPU

A random tiny model never writes a ~70-character tool call, so RL alone has nothing to reward. The
demonstrations are whole episodes, rendered exactly as the agent loop renders them (same prompt, same
observation tokens): the user asks for a key, the assistant calls lookup, the tool answers a digit, the
assistant answers "#### D" with it. In `key_fraction` of them the call asks for the question's key, in the
others for an arbitrary one.

Measured on this machine's CPU (500 steps, then GRPO with examples/lookup_multi_turn.yaml's settings):
- key_fraction 1 (the default): the model scores about 0.73 (about 20% of its calls ask for a wrong key);
  GRPO at actor.lr 1e-4 raised it to about 0.80 within 3 steps (wrong-key calls 20% -> 13%); at
  actor.lr 2e-3 the policy collapsed within 2 steps (calls lost their format).
- 200 steps instead of 500: the model has not learned to copy the key yet (about 80% wrong-key calls,
  score about 0.01), and GRPO at actor.lr 3e-4 then loses the call format within 10 steps.
- key_fraction 0.25: the model does not learn to copy the key at all (about 95% wrong-key calls, score
  about 0.05), and 15 GRPO steps did not teach it: learning to copy from rewards alone takes far longer
  (as rlfabric.quickstart.warm_start says of the letters).
- 1000 steps, then 100 steps on episodes of which 10% call the tool and the rest guess (call_fraction
  0.1): greedy validation scores 0.08-0.09 and 4-5% of samples call; 12 GRPO steps at actor.lr 5e-4
  take validation to 1.0 and the calls to 96% (the sampled score 0.10-0.14 -> 0.82), for seeds 0 and 3.
  Wrong-key calls are rare after 1000 steps: the remaining failures are calls whose format breaks when
  sampled at temperature 1.
"""

from __future__ import annotations

import random
import string
import time
from pathlib import Path

import torch

from rlfabric.env.items import Message
from rlfabric.env.lookup import LOOKUP_SPEC, QUESTION
from rlfabric.quickstart.tiny_model import make_tiny_model
from rlfabric.quickstart.warm_start import QUICKSTART_INIT_RANGE, WarmStartResult, fine_tune
from rlfabric.rollout.agent_loop import observation_ids, render_prompt

# make_lookup_model's arguments for a model that can write the call but mostly guesses: the starting point
# where RL has to learn that the tool pays (tests/coordinator/test_agent_learning.py, bench.async_bench).
LEARNER = {"steps": 1000, "call_fraction": 0.1}
CALL = '<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'


def demonstration(tokenizer, rng: random.Random, key_fraction: float = 1.0,
                  call_fraction: float = 1.0) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one episode: labels on the assistant's turns (with their end), -100 elsewhere.
    With probability call_fraction the assistant calls lookup (for the question's key with probability
    key_fraction, else for an arbitrary one) and answers with the tool's digit; otherwise it answers at
    once with a guessed digit."""
    key, value = rng.choice(string.ascii_lowercase), str(rng.randint(0, 9))
    eos = tokenizer.eos_token_id
    prompt = render_prompt(tokenizer, [{"role": "user", "content": QUESTION.format(key=key)}], [LOOKUP_SPEC])
    if rng.random() >= call_fraction:
        guess = tokenizer.encode(f"#### {rng.randint(0, 9)}", add_special_tokens=False) + [eos]
        return prompt + guess, [-100] * len(prompt) + guess
    called = key if rng.random() < key_fraction else rng.choice(string.ascii_lowercase)
    call = tokenizer.encode(CALL.format(key=called), add_special_tokens=False) + [eos]
    observed = observation_ids(tokenizer, [Message("tool", value)], call)
    final = tokenizer.encode(f"#### {value}", add_special_tokens=False) + [eos]
    ids = prompt + call + observed + final
    labels = [-100] * len(prompt) + call + [-100] * len(observed) + final
    return ids, labels


def _collate_episodes(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids and labels (every episode starts at position 0)."""
    width = max(len(ids) for ids, _ in examples)
    return {"input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in examples]),
            "labels": torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in examples]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in examples])}


def warm_start_lookup(model_dir: str | Path, steps: int = 500, batch_size: int = 16, lr: float = 3e-3,
                      seed: int = 0, key_fraction: float = 1.0, call_fraction: float = 1.0) -> WarmStartResult:
    """Fine-tunes the model in model_dir in place on lookup demonstrations; the learning rate decays to 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(seed)
    def next_batch() -> dict[str, torch.Tensor]:
        return _collate_episodes([demonstration(tokenizer, rng, key_fraction, call_fraction) for _ in range(batch_size)],
                        tokenizer.pad_token_id)

    loss = fine_tune(model, next_batch, steps, lr, seed)
    model.save_pretrained(model_dir)
    return WarmStartResult(model_dir, loss, time.perf_counter() - started)


def make_lookup_model(out_dir: str | Path, seed: int = 0, steps: int = 500, call_fraction: float = 1.0) -> Path:
    """The tiny model (the quickstart's wider initialisation), warm-started on lookup episodes; returns its path.

    With call_fraction < 1 a second, short warm start (100 steps) on episodes that call the tool with that
    probability, and otherwise guess, leaves a model that can use the tool but mostly guesses: its score is
    about the guess's 0.1, and RL has to learn that calling the tool pays (tests/coordinator/
    test_agent_learning.py)."""
    make_tiny_model(out_dir, initializer_range=QUICKSTART_INIT_RANGE, seed=seed)
    warm_start_lookup(out_dir, steps=steps, seed=seed)
    if call_fraction < 1:
        warm_start_lookup(out_dir, steps=100, lr=1e-3, seed=seed + 1, call_fraction=call_fraction)
    return Path(out_dir)
