"""Model-based reward: a sequence-classification model scores chat-formatted prompt + response."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlfabric.core.dtypes import torch_dtype
from rlfabric.reward.items import ItemResult, ScoreItem

Chat = list[dict[str, str]]


@dataclass
class ModelRewardConfig:
    """A reward model loaded from a local directory (HF format)."""

    model_path: str
    """Directory with the model (AutoModelForSequenceClassification) and, by default, its tokenizer."""
    tokenizer_path: str | None = None
    """Directory with the tokenizer, when it is not model_path."""
    device: str = "cpu"
    """Torch device to run on, e.g. "cuda:0"."""
    dtype: str = "float32"
    """Weights dtype: "float32", "bfloat16" or "float16"."""
    batch_size: int = 16
    """Sequences per forward pass."""
    max_length: int | None = None
    """Longest sequence in tokens; longer ones lose their start (the end, where the score is read, stays)."""


class RewardModelScorer:
    """Scores (prompt, response) pairs with a reward model: one float per pair."""

    def __init__(self, config: ModelRewardConfig):
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # Right padding + the model's pad_token_id: the model reads each row's last non-pad token.
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            config.model_path, dtype=torch_dtype(config.dtype, config.device)
        )
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(config.device).eval()

    def format(self, prompt: str | Chat, response: str) -> str:
        """The text the model reads: the chat template applied to prompt + response, if the
        tokenizer has one, else prompt + response concatenated (a string prompt is one user turn)."""
        if self.tokenizer.chat_template is None:
            prompt_text = prompt if isinstance(prompt, str) else "".join(turn["content"] for turn in prompt)
            return prompt_text + response
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(turn) for turn in prompt]
        chat.append({"role": "assistant", "content": response})
        return self.tokenizer.apply_chat_template(chat, tokenize=False)

    def score(self, prompts: Sequence[str | Chat], responses: Sequence[str]) -> list[float]:
        """One reward per (prompt, response): the logit of label 0."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        texts = [self.format(prompt, response) for prompt, response in zip(prompts, responses, strict=True)]
        # A chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS).
        add_special_tokens = self.tokenizer.chat_template is None
        scores: list[float] = []
        for start in range(0, len(texts), self.config.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.config.batch_size],
                padding=True,
                truncation=self.config.max_length is not None,
                max_length=self.config.max_length,
                add_special_tokens=add_special_tokens,
                return_tensors="pt",
            ).to(self.config.device)
            with torch.no_grad():
                logits = self.model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits
            scores.extend(logits[:, 0].float().tolist())  # logits: (B, num_labels)
        return scores

    def score_items(self, items: Sequence[ScoreItem]) -> list[ItemResult]:
        """score() over items' conversation (prompt_messages, else prompt) and response, as ItemResults."""
        prompts = [list(item.prompt_messages) if item.prompt_messages else item.prompt for item in items]
        scores = self.score(prompts, [item.response for item in items])
        return [ItemResult(score=score) for score in scores]
