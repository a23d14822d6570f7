"""A tiny Qwen2-style causal LM with random weights and a character-level tokenizer.

Used by tests and the quickstart (no model hub here): `rlfabric make-tiny-model OUT`.
Every printable ASCII character and newline is one token, plus ChatML specials, so any text
round-trips exactly. head_dim is 32 so vLLM's CPU attention can load it.

`--moe` makes a tiny Qwen3-MoE instead (make_tiny_moe_model): the same tokenizer and widths, each
layer's MLP replaced by a router over 4 experts, 2 per token. vLLM's CPU MoE kernels want the hidden
size a multiple of 32.

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
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
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
    moe: bool = False,
) -> Path:
    """Writes a random-weight Qwen2ForCausalLM (moe: Qwen3MoeForCausalLM, see make_tiny_moe_model) and its
    tokenizer to out_dir; returns the path.

    initializer_range is the std of the random weights (Qwen2's default 0.02; the quickstart model
    uses a wider one, see rlfabric.quickstart.warm_start).
    """
    if moe:
        return make_tiny_moe_model(out_dir, hidden_size, num_layers, num_heads, seed=seed,
                                   initializer_range=initializer_range)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        intermediate_size=intermediate_size,
        **_shared_config(tokenizer, hidden_size, num_layers, num_heads, initializer_range),
    )
    return _save(Qwen2ForCausalLM, config, tokenizer, out_dir, seed)


def make_tiny_moe_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_experts: int = 4,
    experts_per_token: int = 2,
    expert_size: int = 64,
    seed: int = 0,
    initializer_range: float = 0.02,
) -> Path:
    """Writes a random-weight Qwen3MoeForCausalLM (every layer sparse: a top-`experts_per_token` router
    over `num_experts` experts of width `expert_size`) and the tokenizer to out_dir; returns the path.
    The router's load-balancing loss is off, as in Qwen3MoeConfig (the actor adds it with
    actor.router_aux_loss_coef)."""
    if hidden_size % 32:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of 32: vLLM's CPU MoE cannot load it")
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        intermediate_size=expert_size,  # only used by dense layers (mlp_only_layers): there are none
        moe_intermediate_size=expert_size,
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        norm_topk_prob=True,  # the chosen experts' weights sum to 1, as in Qwen3-30B-A3B
        **_shared_config(tokenizer, hidden_size, num_layers, num_heads, initializer_range),
    )
    return _save(Qwen3MoeForCausalLM, config, tokenizer, out_dir, seed)


def make_tiny_mixtral_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_experts: int = 4,
    experts_per_token: int = 2,
    expert_size: int = 64,
    seed: int = 0,
    initializer_range: float = 0.02,
) -> Path:
    """Writes a random-weight MixtralForCausalLM (every layer sparse, the chosen experts' weights always
    renormalised, no router jitter) and the tokenizer to out_dir, as make_tiny_moe_model; returns the path."""
    tokenizer = build_tokenizer()
    config = MixtralConfig(
        intermediate_size=expert_size,  # Mixtral's name for the expert width
        num_local_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        router_jitter_noise=0.0,
        **_shared_config(tokenizer, hidden_size, num_layers, num_heads, initializer_range),
    )
    return _save(MixtralForCausalLM, config, tokenizer, out_dir, seed)


def _shared_config(tokenizer, hidden_size: int, num_layers: int, num_heads: int, initializer_range: float) -> dict:
    """The config fields the dense and MoE tiny models share."""
    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(f"head_dim {head_dim} < 32: vLLM CPU attention cannot load it")
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def _save(model_class, config, tokenizer, out_dir: str | Path, seed: int) -> Path:
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
