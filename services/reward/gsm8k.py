"""GSM8K rule-based reward, scoring the same strings the same way as VeRL's gsm8k.py.

strict:   the last "#### <number>" in the response, commas removed.
flexible: the last number-like run of digits, '.', ',' and a leading '-' (commas kept).
Only the last 300 characters of the response are searched.
"""

from __future__ import annotations

import re

CLIP_CHARS = 300
"""Only the response's last 300 characters are searched (VeRL: a cheap stand-in for ~300 tokens)."""

_STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_NOT_AN_ANSWER = ("", ".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string the response gives, or None when it gives none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        answers = _STRICT_ANSWER.findall(tail)
        if not answers:
            return None
        # "$" cannot occur in a match; removing it too keeps the rule as VeRL states it.
        return answers[-1].replace(",", "").replace("$", "")

    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    for number in reversed(numbers):
        if number not in _NOT_AN_ANSWER:
            return number
    # Every candidate was ".": VeRL's loop then ends on the first one and compares it (-> format_score).
    return numbers[0]


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """score if the extracted answer equals ground_truth exactly, format_score if it differs, 0 if none."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
