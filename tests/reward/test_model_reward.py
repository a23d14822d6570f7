"""Reward model scorer: batched, padded scores equal a direct single-sequence forward."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from rlfabric.reward import STATUS_OK, ScoreItem
from rlfabric.reward.model_reward import ModelRewardConfig, RewardModelScorer

SENTENCES = [
    "what is two plus two",
    "the answer is four",
    "user assistant :",
    "how many apples does she have left",
    "she has three apples left after lunch",
    "i do not know the answer",
]
PROMPTS = ["what is two plus two", "how many apples does she have left", "what is two", "how many", "plus"]
RESPONSES = [
    "the answer is four",
    "three",
    "i do not know the answer she has apples",
    "four apples left",
    "two",
]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [EOS] {% endfor %}"


def build_tokenizer(with_pad: bool) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"])
    tokenizer.train_from_iterator(SENTENCES, trainer)
    special = {"unk_token": "[UNK]", "eos_token": "[EOS]"}
    if with_pad:
        special["pad_token"] = "[PAD]"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


def save_qwen2(tmp_path, chat_template: str | None) -> ModelRewardConfig:
    """A random Qwen2 reward model and its tokenizer, in two directories.

    Separate, because transformers 5's AutoTokenizer gives any qwen2 model directory a Qwen2Tokenizer,
    which would rebuild our word-level vocabulary as a byte-level BPE.
    """
    tokenizer = build_tokenizer(with_pad=True)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "model")
    return ModelRewardConfig(model_path=str(tmp_path / "model"), tokenizer_path=str(tmp_path / "tokenizer"))


def direct_score(model_path, tokenizer_path, text: str, label: int = 0) -> float:
    """Score one sequence with no padding, straight through the model loaded from disk."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, T)
    with torch.no_grad():
        return model(input_ids=input_ids).logits[0, label].item()


def test_batched_scores_match_direct_forward_plain_concatenation(tmp_path):
    config = save_qwen2(tmp_path, chat_template=None)
    config.batch_size = 3
    scorer = RewardModelScorer(config)
    texts = [prompt + " " + response for prompt, response in zip(PROMPTS, RESPONSES, strict=True)]
    lengths = {len(scorer.tokenizer(text)["input_ids"]) for text in texts}
    assert len(lengths) > 2  # rows really are padded within a batch

    scores = scorer.score([prompt + " " for prompt in PROMPTS], RESPONSES)
    expected = [direct_score(config.model_path, config.tokenizer_path, text) for text in texts]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) > 1  # a real signal, not a constant


def test_chat_template_is_applied(tmp_path):
    config = save_qwen2(tmp_path, chat_template=CHAT_TEMPLATE)
    config.batch_size = 2
    scorer = RewardModelScorer(config)
    texts = [
        f"user : {prompt} [EOS] assistant : {response} [EOS] "
        for prompt, response in zip(PROMPTS, RESPONSES, strict=True)
    ]
    assert scorer.format(PROMPTS[0], RESPONSES[0]) == texts[0]
    # A prompt already in chat form is extended with the response turn.
    assert scorer.format([{"role": "user", "content": PROMPTS[0]}], RESPONSES[0]) == texts[0]

    scores = scorer.score(PROMPTS, RESPONSES)
    expected = [direct_score(config.model_path, config.tokenizer_path, text) for text in texts]
    assert scores == pytest.approx(expected, abs=1e-5)

    results = scorer.score_items(
        [ScoreItem("rm", r, "", prompt=p) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    )
    assert [r.status for r in results] == [STATUS_OK] * len(PROMPTS)
    assert [r.score for r in results] == pytest.approx(scores, abs=1e-6)


def test_llama_without_pad_token_two_labels_reads_label_0(tmp_path):
    tokenizer = build_tokenizer(with_pad=False)
    tokenizer.save_pretrained(tmp_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=2,
    )
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)

    scorer = RewardModelScorer(ModelRewardConfig(model_path=str(tmp_path), batch_size=4))
    assert scorer.tokenizer.pad_token == "[EOS]"  # falls back to EOS for padding
    scores = scorer.score(PROMPTS, [" " + response for response in RESPONSES])
    texts = [prompt + " " + response for prompt, response in zip(PROMPTS, RESPONSES, strict=True)]
    assert scores == pytest.approx(
        [direct_score(tmp_path, tmp_path, text, label=0) for text in texts], abs=1e-5
    )
    assert scores != pytest.approx(
        [direct_score(tmp_path, tmp_path, text, label=1) for text in texts], abs=1e-5
    )


def test_mismatched_lengths(tmp_path):
    scorer = RewardModelScorer(save_qwen2(tmp_path, chat_template=None))
    with pytest.raises(ValueError):
        scorer.score(["a", "b"], ["c"])
