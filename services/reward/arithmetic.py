"""Small arithmetic for a real pretrained chat model: "What is 7 + 5? Answer with just the number."

The task of the real-model example and test (examples/smollm2_arithmetic.yaml). SmolLM2-135M-Instruct
knows the sums but rarely says them plainly: sampled at temperature 1 it often talks around the
question, so about 0.3 of its replies end on the right number at the start. GRPO teaches it to answer.
    1.0  the last integer in the reply is the sum
    0.0  anything else (no number, a wrong one)
"""

from __future__ import annotations

import random
import re

DATA_SOURCE = "rlfabric/arithmetic"
QUESTION = "What is {a} + {b}? Answer with just the number."
_INTEGER = re.compile(r"-?\d+")


def make_example(rng: random.Random, low: int = 2, high: int = 9) -> tuple[str, str]:
    """(prompt text, answer) for one sum of two integers in [low, high]."""
    a, b = rng.randint(low, high), rng.randint(low, high)
    return QUESTION.format(a=a, b=b), str(a + b)


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None, **unused) -> float:
    """1.0 when the reply's last integer is the answer, else 0.0."""
    numbers = _INTEGER.findall(solution_str)
    return 1.0 if numbers and numbers[-1] == ground_truth.strip() else 0.0
