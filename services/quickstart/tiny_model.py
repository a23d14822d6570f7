"""A tiny Qwen2-style causal LM with random weights and a character-level tokenizer.

Used by tests and the quickstart (no model hub here): `rlfabric make-tiny-model OUT`.
Every printable ASCII character and newline is one token, plus ChatML specials, so any text
round-trips exactly. head_dim is 32 so vLLM's CPU attention can load it.

The tokenizer is a byte-level BPE with no merges, the same pipeline as Qwen2's own tokenizer:
transformers 5 loads any qwen2 directory with `Qwen2Tokenizer`, which rebuilds its pipeline from
vocab and merges and ignores tokenizer.json's pre-tokenizer. A byte-level vocabulary gives the same
ids whichever class loads it (AutoTokenizer, PreTrainedTokenizerFast, vLLM).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
PAD, IM_START, IM_END, UNK = SPECIAL_TOKENS
# ChatML, as Qwen2 models use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII + newline, with ChatML special tokens."""
    characters = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    byte_symbol = bytes_to_unicode()  # byte -> printable stand-in, as GPT-2/Qwen2 byte-level BPE spells it
    symbols = [byte_symbol[ord(character)] for character in characters]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + symbols)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        padding_side="left",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def make_tiny_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    initializer_range: float = 0.02,
) -> Path:
    """Writes a random-weight Qwen2ForCausalLM and its tokenizer to out_dir; returns the path.

    initializer_range is the std of the random weights (Qwen2's default 0.02; the quickstart model
    uses a wider one, see rlfabric.quickstart.warm_start).
    """
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    vocab_size = len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if config.head_dim < 32:
        raise ValueError(f"head_dim {config.head_dim} < 32: vLLM CPU attention cannot load it")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
