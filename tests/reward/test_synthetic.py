"""The quickstart task's scorer and example generator."""

import random

from rlfabric.reward import compute_score
from rlfabric.reward.synthetic import DATA_SOURCE, INSTRUCTION, LETTERS, make_example


def test_shaped_scores():
    assert compute_score(DATA_SOURCE, "d", "d") == 1.0
    assert compute_score(DATA_SOURCE, " d\n", "d") == 1.0
    assert compute_score(DATA_SOURCE, "dd e", "d") == 0.5
    assert compute_score(DATA_SOURCE, "a", "d") == 0.1
    assert compute_score(DATA_SOURCE, "z", "d") == 0.0
    assert compute_score(DATA_SOURCE, "", "d") == 0.0


def test_examples_answer_with_the_last_letter():
    rng = random.Random(0)
    for _ in range(50):
        prompt, answer = make_example(rng)
        assert prompt.startswith(INSTRUCTION)
        letters = prompt.removeprefix(INSTRUCTION).split(" ")
        assert len(letters) == 3 and set(letters) <= set(LETTERS) and answer == letters[-1]
