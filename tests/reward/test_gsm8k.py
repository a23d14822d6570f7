"""GSM8K scorer: expected values follow VeRL's rule, worked out by hand."""

import pytest

from rlfabric.reward import gsm8k


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("#### 1,234", "1234", 1.0),  # commas are removed
        ("#### -5", "-5", 1.0),
        ("#### 72 dollars in total", "72", 1.0),  # trailing text is not part of the number
        ("#### 10\nwait, no.\n#### 12", "12", 1.0),  # the last #### wins
        ("#### 10\nwait, no.\n#### 12", "10", 0.0),
        ("#### 72.", "72", 0.0),  # "72." is what the regex takes: not equal
        ("#### 3.50", "3.5", 0.0),  # exact string equality, not numeric
        ("####72", "72", 0.0),  # needs the space
        ("#### $72", "72", 0.0),  # "$" right after "#### " means no match at all
        ("The answer is 72", "72", 0.0),  # no #### at all
    ],
)
def test_strict(response, ground_truth, expected):
    assert gsm8k.compute_score(response, ground_truth) == expected


def test_strict_wrong_answer_gets_format_score_but_no_answer_gets_zero():
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no marker, 7", "7", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 7", "7", format_score=0.1, score=2.0) == 2.0


def test_only_last_300_characters_are_searched():
    # "#### 72" is 7 characters: with 293 more the response is 300 long and the marker is kept,
    # with 294 more its first "#" falls off and "### 72" no longer matches.
    assert gsm8k.compute_score("#### 72" + "x" * 293, "72") == 1.0
    assert gsm8k.compute_score("#### 72" + "x" * 294, "72") == 0.0
    assert gsm8k.compute_score("The answer is 72" + " " * 300, "72", method="flexible") == 0.0


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("I think it is 41, no, 42", "42", 1.0),
        ("There are 42 apples.", "42", 1.0),  # the final "." is a match of its own and is skipped
        ("The answer is 42.", "42", 0.0),  # "42." is one match: not equal to "42"
        ("It costs 1,234", "1234", 0.0),  # flexible keeps commas
        ("It costs 1,234", "1,234", 1.0),
        ("The change is -7", "-7", 1.0),
        ("#### 5 then I computed 6", "5", 0.0),  # flexible takes the last number, not the marker
        ("no digits here", "5", 0.0),
    ],
)
def test_flexible(response, ground_truth, expected):
    assert gsm8k.compute_score(response, ground_truth, method="flexible") == expected


def test_flexible_extraction():
    assert gsm8k.extract_solution("a 1 b 2 c 3", method="flexible") == "3"
    assert gsm8k.extract_solution("no digits here", method="flexible") is None
    # Only "." candidates: VeRL's loop ends on one and compares it, so a wrong answer, not none.
    assert gsm8k.extract_solution("well . then", method="flexible") == "."
    assert gsm8k.compute_score("well . then", "5", method="flexible", format_score=0.1) == 0.1


def test_strict_extraction_and_bad_method():
    assert gsm8k.extract_solution("#### 1,000,000") == "1000000"
    assert gsm8k.extract_solution("nothing") is None
    with pytest.raises(ValueError, match="method"):
        gsm8k.extract_solution("#### 1", method="loose")
