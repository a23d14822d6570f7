r"""MATH scorer: expected values follow VeRL's math.py rules (Hendrycks normalisation), worked out by hand."""

import pytest

from rlfabric.reward import math_equiv


@pytest.mark.parametrize(
    ("answer", "ground_truth"),
    [
        ("\\frac12", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("\\frac1{72}", "\\frac{1}{72}"),
        ("0.5", "\\frac{1}{2}"),
        ("0.5", "\\frac12"),
        (".5", "\\frac{1}{2}"),  # ".5" -> "0.5" -> \frac{1}{2}
        (" .5", "\\frac12"),
        ("1/2", "\\frac{1}{2}"),
        ("1/2", "0.5"),
        ("-1/2", "\\frac{-1}{2}"),
        ("5 \\text{ cm}", "5"),  # a unit written "\text{ unit}" goes
        ("5\\text{ cm}^2", "5"),
        ("x + 1", "x+1"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("50\\%", "50"),
        ("\\$5", "5"),
        ("x = 5", "5"),
        ("ab=5", "5"),  # a left-hand side of up to two characters goes
        ("\\sqrt3", "\\sqrt{3}"),
        ("2\\sqrt2", "2\\sqrt{2}"),
        ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"),
        ("1\\!000", "1000"),
        ("\\\\frac{1}{2}", "\\frac12"),  # "\\" -> "\"
        ("7\n", "7"),
    ],
)
def test_equivalent(answer, ground_truth):
    assert math_equiv.is_equiv(answer, ground_truth)
    assert math_equiv.is_equiv(ground_truth, answer)


@pytest.mark.parametrize(
    ("answer", "ground_truth"),
    [
        ("0.50", "\\frac{1}{2}"),  # only the exact string "0.5" is rewritten
        ("0.25", "\\frac14"),
        ("2/4", "\\frac12"),  # no reduction
        ("5\\text{cm}", "5"),  # no space after the brace: not taken for a unit
        ("50%", "50"),  # only "\%" is removed
        ("5.", "5"),  # a trailing "." stays
        ("\\frac{1}{2}.", "\\frac{1}{2}"),
        ("abc=5", "5"),
        ("10.0", "10"),
        ("1,000", "1000"),
        ("\\sqrt 3", "\\sqrt3"),  # the space becomes the root: \sqrt{ }3 -> \sqrt{}3
        ("3", "4"),
    ],
)
def test_not_equivalent(answer, ground_truth):
    assert not math_equiv.is_equiv(answer, ground_truth)


def test_unnormalisable_strings_are_compared_raw():
    # A "\sqrt" with nothing after it stops the normaliser: the raw strings are compared,
    # so spaces that normalisation would remove now matter.
    assert math_equiv.is_equiv("x\\sqrt", "x\\sqrt")
    assert not math_equiv.is_equiv("x\\sqrt", "x \\sqrt")
    # Two "\text{ " units: same rule.
    assert math_equiv.is_equiv("1 \\text{ cm} 2 \\text{ m}", "1 \\text{ cm} 2 \\text{ m}")
    assert not math_equiv.is_equiv("1 \\text{ cm} 2 \\text{ m}", "1 \\text{ cm}  2 \\text{ m}")


def test_none_and_non_string():
    assert math_equiv.is_equiv(None, None)
    assert not math_equiv.is_equiv("5", None)
    assert not math_equiv.is_equiv("5", 5)


def test_strip_string():
    assert math_equiv.strip_string("\\left(\\dfrac{1}{2}, 3^\\circ\\right)") == "(\\frac{1}{2},3)"
    assert math_equiv.strip_string("k = \\frac34") == "\\frac{3}{4}"
    assert math_equiv.strip_string("") == ""


def test_last_boxed_only_string():
    assert math_equiv.last_boxed_only_string("a \\boxed{x^{2}} b \\boxed{y_{1}} c") == "\\boxed{y_{1}}"
    assert math_equiv.last_boxed_only_string("so $\\boxed 7$ then") == "\\boxed 7"
    assert math_equiv.last_boxed_only_string("\\fbox{5}") == "\\fbox{5}"
    assert math_equiv.last_boxed_only_string("\\boxed{5") is None
    assert math_equiv.last_boxed_only_string("no box") is None


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("\\boxed{1} no wait \\boxed{2}", "2", 1.0),  # the last box counts
        ("\\boxed{1} no wait \\boxed{2}", "1", 0.0),
        ("The answer is $\\boxed 5$.", "5", 1.0),  # "\boxed " form ends at "$"
        ("\\boxed 5.", "5", 0.0),  # ... or at the end, keeping the "."
        ("\\boxed {5}", "5", 0.0),  # the space form keeps the braces
        ("\\boxed 3 and later \\boxed{4}", "4", 0.0),  # any "\boxed " wins over "\boxed{"
        ("\\fbox{5}", "5", 0.0),  # found, but VeRL's remove_boxed rejects \fbox
        ("\\boxed\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # becomes "\boxed\frac{1}": rejected
        ("\\boxed{5", "5", 0.0),  # unbalanced
        ("no box, 5", "5", 0.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
        ("\\boxed{5 \\text{ cm}}", "5", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ],
)
def test_compute_score(response, ground_truth, expected):
    assert math_equiv.compute_score(response, ground_truth) == expected
