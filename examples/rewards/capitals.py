"""A reward in VeRL's compute_score form, for the capitals example (docs/your-model-data-reward.md).

rlfabric calls it once per response, in a sandboxed worker process (reward.custom_path, docs/sandbox.md):

    compute_score(data_source, solution_str, ground_truth, extra_info)

data_source, ground_truth and extra_info come from the data row (`rlfabric data custom` puts the answer
column in ground_truth and every column but the prompt in extra_info); solution_str is the model's reply.
It returns a dict: "score" is the reward; every other number is logged per step as
reward_extra/<name>/mean (and max, min) in RUN_DIR/metrics.jsonl, here exact_match.
The file imports nothing of rlfabric: the same file works in VeRL.
"""

import re


def words(text):
    """Lower-case words, punctuation dropped: "Paris." and "paris" read the same."""
    return re.findall(r"[a-z]+", text.lower())


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    said, answer = words(solution_str), words(ground_truth)
    # The answer's words, in order, anywhere in the reply ("The capital is Buenos Aires." counts).
    named = any(said[i : i + len(answer)] == answer for i in range(len(said) - len(answer) + 1))
    return {
        "score": 1.0 if named else 0.0,
        "exact_match": 1.0 if said == answer else 0.0,  # the reply is the answer and nothing more
    }
