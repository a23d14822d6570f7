"""The capitals reward as a TRL reward function (reward.custom_signature: trl).

TRL's GRPOTrainer(reward_funcs=[capital_named]) calls it with lists, one entry per completion, and every
column of the data set as a keyword argument; rlfabric does the same, in the sandboxed reward workers:

    capital_named(prompts=[...], completions=[...], answer=[...], country=[...], ground_truth=[...], ...)

`answer` and `country` are columns of examples/data/capitals.jsonl, kept under their own names in
extra_info by `rlfabric data custom`. It returns one float per completion. The file imports nothing of
rlfabric: the same function works in TRL.
"""

import re


def words(text):
    return re.findall(r"[a-z]+", text.lower())


def capital_named(prompts, completions, answer, **kwargs):
    scores = []
    for completion, truth in zip(completions, answer):
        said, expected = words(completion), words(truth)
        named = any(said[i : i + len(expected)] == expected for i in range(len(said) - len(expected) + 1))
        scores.append(1.0 if named else 0.0)
    return scores
