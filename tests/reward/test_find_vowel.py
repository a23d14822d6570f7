"""The quickstart task's scorer and example generators."""

import random

from rlfabric.reward import compute_score
from rlfabric.reward.find_vowel import (
    CONSONANTS,
    DATA_SOURCE,
    INSTRUCTION,
    LETTERS,
    NUM_LETTERS,
    VOWELS,
    WARM_START_INSTRUCTION,
    make_example,
    make_warm_start_example,
)


def test_shaped_scores():
    assert compute_score(DATA_SOURCE, "E", "E") == 1.0
    assert compute_score(DATA_SOURCE, " E\n", "E") == 1.0
    assert compute_score(DATA_SOURCE, "EB", "E") == 0.5
    assert compute_score(DATA_SOURCE, "B", "E") == 0.0
    assert compute_score(DATA_SOURCE, "e", "E") == 0.0
    assert compute_score(DATA_SOURCE, "", "E") == 0.0


def test_examples_hold_one_vowel_among_consonants():
    rng = random.Random(0)
    answers = set()
    for _ in range(200):
        prompt, answer = make_example(rng)
        assert prompt.startswith(INSTRUCTION)
        letters = prompt.removeprefix(INSTRUCTION).split(" ")
        assert len(letters) == len(set(letters)) == NUM_LETTERS
        assert [c for c in letters if c in VOWELS] == [answer]
        assert set(letters) - {answer} <= set(CONSONANTS)
        answers.add(answer)
    assert answers == set(VOWELS)


def test_warm_start_examples_accept_every_shown_letter():
    """One to six letters among dashes, vowels and consonants alike: no hint of the task's answer."""
    rng = random.Random(0)
    shown_letters, counts = [], set()
    for _ in range(2000):
        prompt, answers = make_warm_start_example(rng)
        assert prompt.startswith(WARM_START_INSTRUCTION)
        slots = prompt.removeprefix(WARM_START_INSTRUCTION).split(" ")
        shown = [c for c in slots if c != "-"]
        assert len(slots) == NUM_LETTERS and 1 <= len(shown) <= NUM_LETTERS
        assert len(set(shown)) == len(shown) and sorted(answers) == sorted(shown)
        shown_letters += shown
        counts.add(len(shown))
    assert counts == set(range(1, NUM_LETTERS + 1))
    assert set(shown_letters) == set(LETTERS)
    vowel_share = sum(c in VOWELS for c in shown_letters) / len(shown_letters)
    assert abs(vowel_share - len(VOWELS) / len(LETTERS)) < 0.05
