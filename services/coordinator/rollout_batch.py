"""One step's rollouts as the tensors the actor, reference and critic take (rlfabric.trainer.batch layout).

    input_ids      [B, P+T]  the prompt left-padded to P, then the response right-padded to T
    attention_mask [B, P+T]  1 = real token
    responses      [B, T]    == input_ids[:, -T:]
    response_mask  [B, T]    1 = a response token the model sampled: 0 on padding and, in multi-turn
                             samples, on the tokens the environment gave (every estimator and loss
                             reads this mask, so they never train on the environment's tokens)
    rollout_log_probs [B, T] the rollout engine's log-prob of each sampled token, 0 on padding (a
                             RolloutBatch field; None when a sample came back without them)
    routed_experts [B, P+T, layers, top_k] the experts each MoE layer chose for each token, uint8 with 255
                             (int32 with -1) where none (a RolloutBatch field, for the actor alone; None
                             unless every sample has them: actor.router_replay)

B = prompts x n samples, ordered prompt by prompt (rows of one prompt form its GRPO group).
P and T are the longest prompt and response of this batch, not the configured maxima: padding
costs compute in every service. A multi-turn sample brings its own prompt ids (rendered with the
environment's tools) and its loss mask; a single-turn sample's prompt is its row's.

Agent episodes (build_episode_batch): E = prompts x n episodes, and B = their segments (zero or more
each; a segment brings its prompt ids and loss mask as a multi-turn sample does). episode_ids [B] says
whose each row is; the episodes' scores are [E], so advantages are taken per episode and shared by its
segments (rlfabric.gateway.segments.episode_advantages), and an episode with many segments weighs no more.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlfabric.data.dataset import PromptRow
from rlfabric.rollout.routes import unrecorded
from rlfabric.rollout.types import Finish, FinishedSample

if TYPE_CHECKING:
    from rlfabric.coordinator.sample_failures import SampleFailure


@dataclass
class RolloutBatch:
    """The samples of one step plus what the loop computes for them, filled in phase by phase."""

    tensors: dict[str, torch.Tensor]
    rows: list[PromptRow]  # one per row of the batch (a prompt's row repeated for each of its samples)
    samples: list[FinishedSample]
    group_ids: torch.Tensor  # [B] int64, index of the prompt within the step
    # Agent episodes only (None otherwise: each row is a sample of its own):
    episode_ids: torch.Tensor | None = None  # [B] int64, the row's episode: prompt index * n + sample index
    episode_scores: torch.Tensor | None = None  # [E] each episode's score
    episode_failed: torch.Tensor | None = None  # [E] bool: the episode failed (its agent, or its scoring)
    # Scoring (generation phase):
    scores: torch.Tensor | None = None  # [B] the reward service's score
    score_failed: torch.Tensor | None = None  # [B] bool: the sample got no score (reward or environment failed)
    failures: list[SampleFailure | None] | None = None  # [B] why each sample failed (None: scored)
    reward_extra_info: dict[str, list[float]] = field(default_factory=dict)  # each scorer output but the score
    #                                             (a compute_score dict's other numbers), over the samples that gave it
    reward_components: torch.Tensor | None = None  # [B, K] algorithm.gdpo_reward_keys' scorer outputs, 0 if failed
    baselines: torch.Tensor | None = None  # [B] ReMax: the score of the prompt's greedy response
    rollout_log_probs: torch.Tensor | None = None  # [B, T] the sampler's (pi_rollout), None if a sample had none
    routed_experts: torch.Tensor | None = None  # [B, P+T, layers, top_k] the rollout's routes (router replay)
    # Log-probs and values phase:
    old_log_probs: torch.Tensor | None = None  # [B, T] None when the update takes its own (one optimizer step)
    sum_pi_squared: torch.Tensor | None = None  # [B, T] the actor's sum_v pi(v)^2 (optimal token baselines only)
    ref_log_probs: torch.Tensor | None = None  # [B, T] when a KL term needs the reference
    teacher_log_probs: torch.Tensor | None = None  # [B, T] algorithm.distill: the teacher's, of the sampled tokens
    values: torch.Tensor | None = None  # [B, T] the critic's (GAE)
    # Advantages phase (rollout correction first):
    rollout_is_weights: torch.Tensor | None = None  # [B, T] truncated IS weights of the policy loss
    token_rewards: torch.Tensor | None = None  # [B, T] score on the last token, KL-penalised if configured
    advantages: torch.Tensor | None = None  # [B, T]
    returns: torch.Tensor | None = None  # [B, T]
    train_mask: torch.Tensor | None = None  # [B, T] response_mask without the samples left out of training

    @property
    def num_rows(self) -> int:
        return len(self.samples)

    @property
    def response_mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]

    def response_lengths(self) -> torch.Tensor:
        """[B] response tokens, the environment's included (multi-turn)."""
        return self.tensors["attention_mask"][:, -self.response_mask.shape[1]:].sum(-1)

    def prompt_lengths(self) -> torch.Tensor:
        return self.tensors["attention_mask"].sum(-1) - self.response_lengths()

    def weight_versions(self) -> torch.Tensor:
        return torch.tensor([s.weight_version for s in self.samples], dtype=torch.int64)

    def truncated(self) -> torch.Tensor:
        """[B] bool: the response hit max_tokens."""
        return torch.tensor([s.finish_reason == Finish.LENGTH for s in self.samples])


def build_rollout_batch(rows: Sequence[PromptRow], samples: Sequence[FinishedSample], n: int,
                        pad_token_id: int) -> RolloutBatch:
    """Assembles the samples of `rows` (n each, any order) into a RolloutBatch.

    Raises ValueError when a (prompt, sample) pair is missing or repeated: a batch with a hole
    would silently train on the wrong rows.
    """
    by_key = {(s.prompt_index, s.sample_index): s for s in samples}
    expected = {(p, i) for p in range(len(rows)) for i in range(n)}
    if len(by_key) != len(samples) or set(by_key) != expected:
        missing = sorted(expected - set(by_key))[:5]
        raise ValueError(f"rollout returned {len(samples)} samples for {len(rows)} prompts x n={n}; "
                         f"missing {missing}, duplicates {len(samples) - len(by_key)}")
    ordered = [by_key[(p, i)] for p in range(len(rows)) for i in range(n)]
    return _assembled(rows, ordered, pad_token_id)


def build_episode_batch(rows: Sequence[PromptRow], segments: Sequence[FinishedSample], n: int,
                        pad_token_id: int) -> RolloutBatch:
    """Assembles agent episodes' segments (each a FinishedSample of its episode's (prompt, sample index), an
    episode's in the order it recorded them) into a RolloutBatch, a row per segment, ordered by episode;
    batch.episode_ids says whose each row is. ValueError for a segment of no episode of `rows` x n."""
    outside = [(s.prompt_index, s.sample_index) for s in segments
               if not (0 <= s.prompt_index < len(rows) and 0 <= s.sample_index < n)]
    if outside:
        raise ValueError(f"agent segments of episodes {outside[:5]} outside {len(rows)} prompts x n={n}")
    if not segments:
        raise ValueError(f"none of the {len(rows) * n} agent episodes recorded a call: nothing to train on")
    ordered = sorted(segments, key=lambda s: (s.prompt_index, s.sample_index))  # stable: recorded order kept
    batch = _assembled(rows, ordered, pad_token_id)
    batch.episode_ids = torch.tensor([s.prompt_index * n + s.sample_index for s in ordered], dtype=torch.int64)
    return batch


def _assembled(rows: Sequence[PromptRow], ordered: Sequence[FinishedSample], pad_token_id: int) -> RolloutBatch:
    """The batch of `ordered` samples, each of its prompt_index's row, as the actor takes them (module docstring)."""
    sample_rows = [rows[s.prompt_index] for s in ordered]
    row_prompts = {index: np.asarray(rows[index].prompt_ids, dtype=np.int64)  # once for a row's n samples
                   for index in {s.prompt_index for s in ordered}}
    prompts = [s.prompt_ids if len(s.prompt_ids) else row_prompts[s.prompt_index] for s in ordered]
    prompt_lens = np.array([len(prompt) for prompt in prompts], dtype=np.int64)  # [B]
    response_lens = np.array([len(s.token_ids) for s in ordered], dtype=np.int64)  # [B]
    prompt_len, response_len = int(prompt_lens.max()), max(1, int(response_lens.max()))
    # Each tensor is filled by one masked assignment from the samples' tokens laid end to end (a boolean
    # mask's true cells are taken in row-major order): no Python per token and no copy per row. In numpy,
    # then shared with torch: numpy's masked assignment and fills run several times faster here.
    columns = np.arange(prompt_len + response_len)  # [P+T]
    attention_mask = (columns >= (prompt_len - prompt_lens)[:, None]) & (columns < (prompt_len + response_lens)[:, None])
    input_ids = np.full(attention_mask.shape, pad_token_id, dtype=np.int64)  # [B, P+T]
    input_ids[:, :prompt_len][attention_mask[:, :prompt_len]] = _joined(prompts, np.int64)
    responded = attention_mask[:, prompt_len:]  # [B, T] a view: the response's real tokens
    input_ids[:, prompt_len:][responded] = _joined([s.token_ids for s in ordered], np.int64)
    response_mask = responded.astype(np.int64)
    if any(len(s.loss_mask) for s in ordered):  # multi-turn: the environment's tokens are masked out
        response_mask[responded] = _joined([s.model_token_mask() for s in ordered], np.int64)
    tensors = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask.astype(np.int64)),
        "responses": torch.from_numpy(input_ids[:, prompt_len:]),  # a view: no second copy of the response ids
        "response_mask": torch.from_numpy(response_mask),
    }
    group_ids = torch.tensor([s.prompt_index for s in ordered], dtype=torch.int64)
    return RolloutBatch(tensors, sample_rows, list(ordered), group_ids,
                        rollout_log_probs=_rollout_log_probs(ordered, responded),
                        routed_experts=_routed_experts(ordered, attention_mask))


def _routed_experts(samples: Sequence[FinishedSample], attention_mask: np.ndarray) -> torch.Tensor | None:
    """[B, P+T, layers, top_k] each sample's routes (prompt then response) at its real tokens; None unless every
    sample the model sampled tokens of has them (a multi-turn sample whose environment failed before the first
    turn has none: no token of it is trained). ValueError when a sample's routes do not cover its tokens."""
    routed = [s for s in samples if s.routed_experts is not None]
    if not routed or any(s.routed_experts is None and s.num_model_tokens() for s in samples):
        return None
    lengths = attention_mask.sum(1)
    shape, kind = routed[0].routed_experts.shape[1:], routed[0].routed_experts.dtype
    samples = [s if s.routed_experts is not None else
               replace(s, routed_experts=np.full((length, *shape), unrecorded(kind), dtype=kind))
               for s, length in zip(samples, lengths, strict=True)]
    for sample, length in zip(samples, lengths, strict=True):
        if len(sample.routed_experts) != length:
            raise ValueError(f"sample ({sample.prompt_index}, {sample.sample_index}) has routes for "
                             f"{len(sample.routed_experts)} tokens but {length} prompt and response tokens")
    first = samples[0].routed_experts
    narrow = all(s.routed_experts.dtype == np.uint8 for s in samples)
    dtype = np.uint8 if narrow else np.int32
    routes = np.full((*attention_mask.shape, *first.shape[1:]), 255 if narrow else -1, dtype=dtype)
    joined = np.concatenate([s.routed_experts for s in samples]).astype(dtype)
    if not narrow:  # uint16's none (65535) as the batch's -1
        joined[joined == np.iinfo(np.uint16).max] = -1
    routes[attention_mask] = joined
    return torch.from_numpy(routes)


def _joined(values: Sequence[Sequence], dtype) -> np.ndarray:
    """The sequences end to end, as one array of `dtype`."""
    return np.concatenate([np.asarray(v, dtype=dtype) for v in values]) if values else np.zeros(0, dtype=dtype)


def _rollout_log_probs(samples: Sequence[FinishedSample], responded: np.ndarray) -> torch.Tensor | None:
    """[B, T] each sample's log-probs, right-padded with 0; None unless every sample has one per token.
    `responded` [B, T]: true on each sample's response tokens."""
    if any(len(s.logprobs) != len(s.token_ids) for s in samples):
        return None
    out = np.zeros(responded.shape, dtype=np.float32)
    out[responded] = _joined([s.logprobs for s in samples], np.float32)
    return torch.from_numpy(out)


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each sequence's score on its last masked-in response token, 0 elsewhere (VeRL's layout). In
    a multi-turn sample that is the model's last token, not an observation's that may follow it."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    masked_in = response_mask.numpy() != 0  # [B, T]; in numpy: no [B, T] int64 of positions (0.5 GB at 4,096 x 16)
    has_tokens = torch.from_numpy(masked_in.any(-1))  # [B]
    last = torch.from_numpy(masked_in.shape[1] - 1 - masked_in[:, ::-1].argmax(-1))  # [B] the last masked-in token
    rows = torch.arange(len(scores))[has_tokens]
    out[rows, last[has_tokens]] = scores[has_tokens].to(torch.float32)
    return out


def write_rollouts(run_dir: Path, step: int, batch: RolloutBatch, with_tokens: bool) -> None:
    """RUN_DIR/rollouts/step_<step>.jsonl (trainer.dump_rollouts): what was generated, from which weights, and
    its score (score_failed: it got none; failure: why, {source, status, message}, see sample_failures.py);
    with_tokens (trainer.dump_rollout_tokens): its token ids and the sampler's log-probs too."""
    folder = run_dir / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    scores, failed = batch.scores.tolist(), batch.score_failed.tolist()
    failures = batch.failures or [None] * len(scores)
    with open(folder / f"step_{step}.jsonl", "w") as out:
        for row, sample, score, score_failed, failure in zip(batch.rows, batch.samples, scores, failed, failures,
                                                              strict=True):
            record = {"uid": row.uid, "sample_index": sample.sample_index, "data_source": row.data_source,
                      "prompt": row.messages[-1]["content"] if row.messages else "",
                      "response": sample.text, "score": score, "score_failed": score_failed,
                      "failure": failure.record() if failure is not None else None,
                      "weight_version": sample.weight_version, "version_spans": sample.version_spans,
                      "ground_truth": row.ground_truth}
            if with_tokens:
                prompt_ids = sample.prompt_ids if len(sample.prompt_ids) else row.prompt_ids
                record.update(prompt_ids=_listed(prompt_ids), response_ids=_listed(sample.token_ids),
                              rollout_log_probs=_listed(sample.logprobs))
            out.write(json.dumps(record) + "\n")


def _listed(values: Sequence) -> list:
    """Python numbers for JSON (a sample's fields may be numpy arrays)."""
    return np.asarray(values).tolist()
