"""A generative judge for tests that need a real one: the quickstart's warm-started tiny model with its output rows
remapped, and the reward.judge overrides that read its verdicts."""

from __future__ import annotations

from pathlib import Path

from rlfabric.quickstart import cached
from rlfabric.reward import find_vowel

# Asked "any letter of: <response>", the judge model writes 1 for a vowel and 0 for a consonant.
VOWEL_JUDGE = [
    "reward.judge.prompt_template='any letter of: {response}'",
    "reward.judge.regex='([01])'",
    "reward.judge.min_score=0",
    "reward.judge.max_score=1",
    "reward.judge.max_tokens=2",
]


def judge_model(out: Path) -> Path:
    """The warm-started tiny model whose output row for "1" is the sum of the vowels' rows and for "0" the
    consonants', the letters' rows zeroed (untied from the input embeddings, which still read letters): where it
    would copy a vowel it writes 1, a consonant 0."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached.copy_cached(0, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    rows = model.lm_head.weight.detach().clone()  # (V, H)
    row = {c: tokenizer.convert_tokens_to_ids(c) for c in find_vowel.VOWELS + find_vowel.CONSONANTS + "01"}
    with torch.no_grad():
        head = rows.clone()
        head[row["1"]] = sum(rows[row[c]] for c in find_vowel.VOWELS)
        head[row["0"]] = sum(rows[row[c]] for c in find_vowel.CONSONANTS)
        for letter in find_vowel.VOWELS + find_vowel.CONSONANTS:
            head[row[letter]] = 0.0
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out)
    return out
