"""HellaSwag as a rule-scored task: pick the ending that fits the context.

The prompt (written by `rlfabric data hellaswag`) shows the context and the endings lettered
A, B, C, D, and asks for the letter. The ground truth is the label: the index of the right ending,
as VeRL's HellaSwag preprocessing keeps it. The policy writes its choice, and a rule reads it back:

    1.0  the chosen ending is the labelled one
    0.0  another ending, or no recognisable choice

How a free-text response chooses (the first rule that finds a choice decides):
    1. an answer phrase with a capital letter (the last one counts): "Answer: B", "the answer is (B)"
    2. the whole response is a letter, alone or wrapped: "B", "(B)", "B.", "B)"
    3. the response contains the text of exactly one ending (case and spacing ignored),
       as extra_info["endings"] holds them
"""

from __future__ import annotations

import re
from typing import Any

DATA_SOURCE = "Rowan/hellaswag"
LETTERS = "ABCDEFGH"
INSTRUCTION = "Answer with the letter of the best ending."

# The letter after an answer phrase must be a capital: "the answer is a dog" chooses nothing.
_ANSWER_PHRASE = re.compile(r"(?i:answer)\s*(?i:is)?\s*[:\-]?\s*\(?([A-H])\b")
_LONE_LETTER = re.compile(r"\(?([A-H])[\.\):]?", re.IGNORECASE)
_TAG = re.compile(r"\[[^\]]*\]")


def clean(text: str) -> str:
    """HellaSwag text as VeRL's preprocessing cleans it: WikiHow's " [title]" becomes ". ", other
    [tags] go, runs of spaces become one."""
    text = text.strip().replace(" [title]", ". ")
    text = _TAG.sub("", text)
    return re.sub(r"\s{2,}", " ", text).strip()


def make_prompt(context: str, endings: list[str]) -> str:
    """The user message: the context, the lettered endings, the instruction."""
    options = "\n".join(f"{LETTERS[index]}. {ending}" for index, ending in enumerate(endings))
    return f"{context}\n\nWhich ending fits best?\n{options}\n{INSTRUCTION}"


def chosen_ending(response: str, endings: list[str] | None, num_endings: int = 4) -> int | None:
    """The index of the ending a response chooses (rules in the module docstring); None if none."""
    count = len(endings) if endings else num_endings
    matches = _ANSWER_PHRASE.findall(response)
    if matches:
        index = LETTERS.index(matches[-1].upper())
        return index if index < count else None
    lone = _LONE_LETTER.fullmatch(response.strip())
    if lone:
        index = LETTERS.index(lone.group(1).upper())
        return index if index < count else None
    if endings:
        text = _normalise(response)
        found = [index for index, ending in enumerate(endings) if _normalise(ending) and _normalise(ending) in text]
        if len(found) == 1:
            return found[0]
    return None


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, **unused: Any) -> float:
    """1.0 if the response chooses the labelled ending (ground_truth: its index, e.g. "2"), else 0.0."""
    endings = (extra_info or {}).get("endings")
    endings = [str(ending) for ending in endings] if isinstance(endings, (list, tuple)) else None
    choice = chosen_ending(solution_str, endings)
    return 1.0 if choice is not None and choice == int(ground_truth) else 0.0


def _normalise(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .")
