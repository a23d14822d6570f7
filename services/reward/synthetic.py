"""The quickstart's synthetic task, small enough for the tiny model to learn on CPU in minutes.

Prompt: "last letter of: c a d" -> the answer is the last letter ("d"), then end of turn.
The score is shaped so that a random policy gets a little signal and RL can climb:
    1.0  the response is exactly the answer (whitespace stripped)
    0.5  it starts with the answer but goes on
    0.1  it starts with one of the task's letters, but the wrong one
    0.0  anything else
"""

from __future__ import annotations

import random

DATA_SOURCE = "rlfabric/last_letter"
LETTERS = "abcde"
INSTRUCTION = "last letter of: "


def make_example(rng: random.Random, length: int = 3) -> tuple[str, str]:
    """(prompt text, answer) for one example."""
    letters = [rng.choice(LETTERS) for _ in range(length)]
    return INSTRUCTION + " ".join(letters), letters[-1]


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None, **unused) -> float:
    """Shaped score in [0, 1] (see the module docstring)."""
    response = solution_str.strip()
    if response == ground_truth:
        return 1.0
    if response.startswith(ground_truth):
        return 0.5
    if response[:1] and response[0] in LETTERS:
        return 0.1
    return 0.0
