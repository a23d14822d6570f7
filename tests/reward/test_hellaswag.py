"""The HellaSwag rule: how a free-text response chooses an ending, and its score."""

from __future__ import annotations

import pytest

from rlfabric.reward.hellaswag import chosen_ending, compute_score
from rlfabric.reward.scoring import compute_score as default_compute_score

ENDINGS = ["takes out golden cookies.", "eats the oven.", "swims across the lake.", "paints the tray blue."]


@pytest.mark.parametrize(
    ("response", "choice"),
    [
        ("Answer: B", 1),
        ("I think the answer is (C) because ovens are hot.", 2),
        ("The answer is A. No wait, the answer is D", 3),  # the last answer phrase counts
        ("b", 1),
        ("(D)", 3),
        ("C.", 2),
        ("She takes out golden cookies.", 0),  # the text of exactly one ending
        ("She Eats   the oven", 1),  # case and spacing ignored
        ("the answer is a dog", None),  # a lower-case word after "answer is" is not a letter
        ("Answer: E", None),  # no fifth ending
        ("eats the oven. or paints the tray blue.", None),  # two endings: no choice
        ("no idea", None),
    ],
)
def test_chosen_ending(response, choice):
    assert chosen_ending(response, ENDINGS) == choice


def test_score_is_one_for_the_labelled_ending_only():
    extra = {"endings": ENDINGS}
    assert compute_score("Answer: C", "2", extra) == 1.0
    assert compute_score("Answer: B", "2", extra) == 0.0
    assert compute_score("swims across the lake", "2", extra) == 1.0
    assert compute_score("C", "2", None) == 1.0  # letters work without the endings
    assert compute_score("nothing", "2", extra) == 0.0
    assert default_compute_score("Rowan/hellaswag", "(C)", "2", extra) == 1.0  # registered by data_source
