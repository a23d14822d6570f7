"""The tiny model's tokenizer gives the same ids and text whichever transformers class loads it."""

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

TEXTS = [
    "last letter of: a b  c",
    "<|im_start|>user\nline one\nline two ~!@#<|im_end|>\n",
    "   leading and trailing spaces   ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_auto_tokenizer_round_trips_spaces_and_matches_fast_tokenizer(tiny_model, text):
    auto = AutoTokenizer.from_pretrained(tiny_model)
    fast = PreTrainedTokenizerFast.from_pretrained(tiny_model)
    auto_ids = auto(text)["input_ids"]
    assert auto_ids == fast(text)["input_ids"]
    assert auto.decode(auto_ids) == text


def test_one_token_per_character(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tokenizer("a b c")["input_ids"]) == 5
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
