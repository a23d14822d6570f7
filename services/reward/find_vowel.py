"""The quickstart's synthetic task, small enough for the tiny model to learn on CPU in a minute.

Prompt: "find the vowel: K B E D C H" -> the answer is the only vowel ("E"), then end of turn.
Every prompt holds one of the vowels A E I O U and five of the consonants B C D F G H, shuffled.
    1.0  the response is exactly the answer (whitespace stripped)
    0.5  it starts with the answer but goes on
    0.0  anything else

The quickstart model is warm-started (rlfabric.quickstart.warm_start) on `make_warm_start_example`:
one to six letters among dashes, "any letter of: - K - - E -" or "any letter of: K B E D C H", where
every shown letter is a right answer. It learns the reply format (one letter, then end of turn) and
to copy any one letter out of the prompt with equal chance, but not which letter this task wants:
its answers are vowels and consonants alike, so its first-step score is about 1 in 6.
Reinforcement learning has to discover that the vowel scores.
"""

from __future__ import annotations

import random

DATA_SOURCE = "rlfabric/find_vowel"
VOWELS = "AEIOU"
CONSONANTS = "BCDFGH"
LETTERS = VOWELS + CONSONANTS
INSTRUCTION = "find the vowel: "
NUM_LETTERS = 6  # letters in a prompt: one vowel, the rest consonants
WARM_START_INSTRUCTION = "any letter of: "


def make_example(rng: random.Random, num_letters: int = NUM_LETTERS) -> tuple[str, str]:
    """(prompt text, answer) for one example of the task."""
    vowel = rng.choice(VOWELS)
    letters = [vowel, *rng.sample(CONSONANTS, num_letters - 1)]
    rng.shuffle(letters)
    return INSTRUCTION + " ".join(letters), vowel


def make_warm_start_example(rng: random.Random, num_slots: int = NUM_LETTERS) -> tuple[str, list[str]]:
    """(prompt text, right answers) for the warm start: 1 to num_slots distinct letters (vowels and
    consonants alike) among dashes; every shown letter is a right answer. With num_slots letters there
    are no dashes and the prompt looks like a task prompt, minus the instruction and the one-vowel rule."""
    shown = rng.sample(LETTERS, rng.randint(1, num_slots))
    slots = ["-"] * num_slots
    for position, letter in zip(rng.sample(range(num_slots), len(shown)), shown, strict=True):
        slots[position] = letter
    return WARM_START_INSTRUCTION + " ".join(slots), shown


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None, **unused) -> float:
    """Shaped score in [0, 1] (see the module docstring)."""
    response = solution_str.strip()
    if response == ground_truth:
        return 1.0
    if response.startswith(ground_truth):
        return 0.5
    return 0.0
