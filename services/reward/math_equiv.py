r"""MATH rule-based reward: the last \boxed answer, Hendrycks-style normalisation, string equality.

Scores the same strings the same way as VeRL's math.py (math_reward.py in newer releases),
quirks included, so rewards match a VeRL run. Notable behaviours it keeps on purpose:

- "\boxed " (with a space) anywhere in the response wins over any "\boxed{...}": the answer is the
  text after the last "\boxed " up to the next "$".
- "\fbox{...}" is found when there is no "\boxed", but VeRL's remove_boxed only accepts "\boxed",
  so an "\fbox" answer always scores 0.0.
- A trailing "." is not removed ("5." is not "5"); "0.5" equals "\frac{1}{2}" and "1/2", but
  "0.50", ".25"-style decimals other than 0.5, and "2/4" are not rewritten.
- Units are dropped only in the form "\text{ unit}" (a space after the brace); "%" only as "\%".
- When normalisation fails (two "\text{ " units, a bare "\frac" or "\sqrt" at the end),
  the raw strings are compared instead.
"""

from __future__ import annotations


class _CannotNormalize(ValueError):
    """strip_string gave up on this string (VeRL hits an assert or an IndexError there)."""


def last_boxed_only_string(string: str) -> str | None:
    r"""The last "\boxed{...}" (braces balanced) or "\boxed ..." form, or "\fbox{...}"; None if absent."""
    if "\\boxed " in string:
        tail = string.rsplit("\\boxed ", 1)[1]
        return "\\boxed " + tail.split("$", 1)[0]

    start = string.rfind("\\boxed")
    if start < 0:
        start = string.rfind("\\fbox")
        if start < 0:
            return None

    depth = 0
    for i in range(start, len(string)):
        char = string[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return string[start : i + 1]
    return None


def remove_boxed(boxed: str) -> str | None:
    r"""The answer inside "\boxed{...}" or after "\boxed "; None for any other form (\fbox included)."""
    if "\\boxed " in boxed:
        return boxed[len("\\boxed ") :] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{") : -1]
    return None


def _fix_fracs(string: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72}; \frac{72}1 is left alone."""
    pieces = string.split("\\frac")
    out = [pieces[0]]
    for piece in pieces[1:]:
        out.append("\\frac")
        if not piece:
            raise _CannotNormalize("\\frac with nothing after it")
        if piece[0] == "{":
            out.append(piece)
            continue
        if len(piece) < 2:
            return string
        numerator, second, rest = piece[0], piece[1], piece[2:]
        if second == "{":
            out.append("{" + numerator + "}{" + rest)
        else:
            out.append("{" + numerator + "}{" + second + "}" + rest)
    return "".join(out)


def _fix_a_slash_b(string: str) -> str:
    r"""'3/4' -> '\frac{3}{4}' when both sides are plain integers written canonically."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    if string != f"{numerator}/{denominator}":
        return string
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _remove_right_units(string: str) -> str:
    r"""Drop a unit written as "\text{ unit}" and everything after it."""
    if "\\text{ " not in string:
        return string
    parts = string.split("\\text{ ")
    if len(parts) != 2:
        raise _CannotNormalize("more than one \\text{ unit")
    return parts[0]


def _fix_sqrt(string: str) -> str:
    r"""\sqrt3 -> \sqrt{3} (one character only: \sqrt12 -> \sqrt{1}2)."""
    if "\\sqrt" not in string:
        return string
    pieces = string.split("\\sqrt")
    out = [pieces[0]]
    for piece in pieces[1:]:
        if not piece:
            raise _CannotNormalize("\\sqrt with nothing after it")
        if piece[0] == "{":
            out.append("\\sqrt" + piece)
        else:
            out.append("\\sqrt{" + piece[0] + "}" + piece[1:])
    return "".join(out)


def strip_string(string: str) -> str:
    """Normalise a MATH answer for comparison (Hendrycks' rules, in VeRL's order)."""
    string = string.replace("\n", "")
    string = string.replace("\\!", "")  # negative thin space
    string = string.replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")  # degrees
    string = string.replace("\\$", "")
    string = _remove_right_units(string)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string

    # A short left-hand side such as "x = " or "k=" goes.
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        string = sides[1]

    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def is_equiv(str1: str | None, str2: str | None) -> bool:
    """Whether two answers are equal after strip_string (raw equality if it cannot normalise them)."""
    if str1 is None or str2 is None:
        return str1 is None and str2 is None
    if not isinstance(str1, str) or not isinstance(str2, str):
        return str1 == str2
    try:
        return strip_string(str1) == strip_string(str2)
    except _CannotNormalize:
        return str1 == str2


def compute_score(solution_str: str, ground_truth: str) -> float:
    r"""1.0 if the last \boxed answer of the response is equivalent to ground_truth, else 0.0."""
    if not isinstance(solution_str, str):
        return 0.0
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    answer = remove_boxed(boxed)
    if answer is None:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0
