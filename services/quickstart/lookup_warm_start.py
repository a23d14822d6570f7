"""A warm start for the multi-turn lookup task (rlfabric.env.lookup): the tiny model learns the Hermes
tool-call format and the shape of an episode, not how to use the tool's answer.

    make_lookup_model(OUT)        # the tiny model, then ~a minute of supervised warm start on CPU

A random tiny model never writes a ~70-character tool call, so RL alone has nothing to reward. The
demonstrations are whole episodes, rendered exactly as the agent loop renders them (same prompt, same
observation tokens): the user asks for a key, the assistant calls lookup with that key, the tool answers
a digit, the assistant answers "#### D" with it. But only one demonstration in KEY_FRACTION calls lookup
with the key the user asked for; the others call it with an arbitrary key (and are shown a digit anyway).
So the warm-started model writes the call and copies what the tool says, but mostly asks for the wrong
key, which the real tool answers with an error (it scores well below 0.3); RL has to teach it to ask for
the key in the question, so that the tool's answer is the one that scores.
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
from rlfabric.quickstart.warm_start import QUICKSTART_INIT_RANGE, WarmStartResult, _one_thread
from rlfabric.rollout.agent_loop import observation_ids, render_prompt

KEY_FRACTION = 0.25  # demonstrations that call lookup with the prompt's key (the rest: an arbitrary key)
CALL = '<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'


def demonstration(tokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one episode: labels on the assistant's two turns (with their end), -100 elsewhere."""
    key, value = rng.choice(string.ascii_lowercase), str(rng.randint(0, 9))
    called = key if rng.random() < KEY_FRACTION else rng.choice(string.ascii_lowercase)
    eos = tokenizer.eos_token_id
    prompt = render_prompt(tokenizer, [{"role": "user", "content": QUESTION.format(key=key)}], [LOOKUP_SPEC])
    call = tokenizer.encode(CALL.format(key=called), add_special_tokens=False) + [eos]
    observed = observation_ids(tokenizer, [Message("tool", value)], call)
    final = tokenizer.encode(f"#### {value}", add_special_tokens=False) + [eos]
    ids = prompt + call + observed + final
    labels = [-100] * len(prompt) + call + [-100] * len(observed) + final
    return ids, labels


def _collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids and labels (every episode starts at position 0)."""
    width = max(len(ids) for ids, _ in examples)
    return {"input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in examples]),
            "labels": torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in examples]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in examples])}


def warm_start_lookup(model_dir: str | Path, steps: int = 300, batch_size: int = 16, lr: float = 3e-3,
                      seed: int = 0) -> WarmStartResult:
    """Fine-tunes the model in model_dir in place on lookup demonstrations; the learning rate decays to 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(seed)
    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        model.train()
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr * (1 - step / steps)
            batch = _collate([demonstration(tokenizer, rng) for _ in range(batch_size)], tokenizer.pad_token_id)
            loss = model(**batch, use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()
    model.save_pretrained(model_dir)
    return WarmStartResult(model_dir, loss.item(), time.perf_counter() - started)


def make_lookup_model(out_dir: str | Path, seed: int = 0, steps: int = 300) -> Path:
    """The tiny model (the quickstart's wider initialisation), warm-started on lookup episodes; returns its path."""
    make_tiny_model(out_dir, initializer_range=QUICKSTART_INIT_RANGE, seed=seed)
    return warm_start_lookup(out_dir, steps=steps, seed=seed).path
