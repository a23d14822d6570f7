"""The model roles: actor (PPO training, LoRA), reference and critic."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from rlfabric.core.config.base import LOSS_MODE_AGGREGATION, Section


class LoraConfig(Section):
    rank: int = Field(0, ge=0)
    """LoRA rank of the actor's adapters (peft); 0 = train every weight (VeRL: model.lora_rank)."""
    alpha: float = Field(16.0, gt=0)
    """The adapters' update is scaled by alpha / rank (VeRL: model.lora_alpha)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: str | list[str] = "all-linear"
    """Layers that get adapters: names or name suffixes (e.g. [q_proj, v_proj]), or all-linear (every
    linear layer but the output head) (VeRL: model.target_modules)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ModelRoleSection(Section):
    """What the three model roles (actor, reference, critic) set alike: their engine, ranks, packing and pool."""

    engine: Literal["torch", "sim"] = "torch"
    """torch = the model trained with torch (FSDP2, tensor parallel); sim = no model: each request takes the time
    sim.trainer's cost model gives, log-probs and values are placeholders, and weight syncs carry a tiny payload
    plus the modelled transfer of the virtual weights (docs/simulation.md)."""

    world_size: int = Field(1, ge=1)
    """Ranks (FSDP2 data-parallel x tensor_parallel_size); rank 0 serves gRPC."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel ranks per model copy (torch DTensor; Llama and Qwen2 families, and Qwen3-MoE and Mixtral
    with their attention split and their MoE blocks whole on each rank): world_size ranks form a
    (world_size / T) x T mesh, FSDP2 across, each decoder layer's projections split T ways within (and an
    untied LM head; the critic's value head stays whole). T must divide world_size and the model's attention
    heads, KV heads and intermediate size. 1 = data parallel."""
    use_remove_padding: bool = False
    """Sequence packing (VeRL's use_remove_padding): each micro-batch's real tokens are packed into rows as
    long as its longest sequence, positions restarting per sequence, so little compute goes to padding. Needs
    an attention backend that keeps packed sequences apart: model.attn_implementation sdpa, eager or
    flash_attention_2/3."""
    share_prompt_forward: bool = True
    """Rows that share their prompt (GRPO's rollout.n samples of one prompt) send it through the model once:
    its keys and values are computed once, for every row's response to attend to. The same log-probs,
    entropies and gradients, with n times less prompt compute. Used on the padded path of a trainer of one
    rank (the actor's update, the actor's and reference's log-probs); sequence packing, more than one rank,
    gradient checkpointing (in the update) and the critic take every row whole."""
    pool: str = ""
    """Key of resource_pools this role runs on; empty = no pool (every device of the machine, as before)."""


class ActorConfig(ModelRoleSection):
    """The actor: the policy's optimizer, batch sizes, policy loss, KL loss and LoRA."""

    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW (decoupled) weight decay."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear LR warmup over this many updates (UpdatePolicy calls), then constant; 0 = constant."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this; a non-finite norm skips the optimizer step."""
    ppo_mini_batch_size: int = Field(8, ge=1)
    """Prompts per optimizer step, summed over ranks (VeRL's meaning: rows = this * rollout.n)."""
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    """Rows per forward/backward on one rank; gradients accumulate over micro-batches."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Rows per forward on one rank in ComputeLogProbs."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget (rows x padded length) per micro-batch on one rank; 0 = fixed row counts above."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the batch per UpdatePolicy."""
    loss_mode: str = "vanilla"
    """Policy loss from rlfabric.algorithms, VeRL's names (VeRL: actor.policy_loss.loss_mode): vanilla (PPO
    clip + dual clip), gspo, gpg, cispo, dppo_tv, dppo_kl, dro, sapo, geo_mean (GMPO), clip_cov, kl_cov,
    bypass_mode (VeRL's bypass mode: needs algorithm.old_log_prob_source rollout, and takes
    algorithm.rollout_correction inside the loss), or one you registered."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses reduce to one number (token-mean, seq-mean-token-sum, ...); when not set, the
    loss mode's own: seq-mean-token-mean for gspo (as in the GSPO paper) and sapo, token-mean otherwise. sapo
    and geo_mean reduce their policy loss their own way whatever this says (as VeRL's do)."""
    clip_ratio_low: float = Field(0.2, ge=0)
    """PPO ratio lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """PPO ratio upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (Ye et al. 2020); with loss_mode dppo_tv or dppo_kl, the
    truncation of their importance weights (the DPPO paper advises a large one, e.g. 20)."""
    clip_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """loss_mode clip_cov: fraction of the valid tokens whose gradient is cut (VeRL:
    actor.policy_loss.clip_cov_ratio)."""
    clip_cov_lb: float = 1.0
    """loss_mode clip_cov: a token may be cut when its covariance (A - mean A) * (log pi - mean log pi) is above
    this (VeRL: actor.policy_loss.clip_cov_lb)."""
    clip_cov_ub: float = 5.0
    """loss_mode clip_cov: ... and below this (VeRL: actor.policy_loss.clip_cov_ub)."""
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """loss_mode kl_cov: fraction of the valid tokens, those of largest covariance, that get the |log ratio|
    penalty (VeRL: actor.policy_loss.kl_cov_ratio)."""
    ppo_kl_coef: float = Field(0.1, ge=0)
    """loss_mode kl_cov: weight of that penalty (VeRL: actor.policy_loss.ppo_kl_coef)."""
    dro_beta: float | None = Field(None, gt=0)
    """loss_mode dro: weight of the quadratic log-ratio penalty, needed by dro (VeRL:
    actor.policy_loss.dro_beta)."""
    tau_pos: float = Field(1.0, gt=0)
    """loss_mode sapo: temperature of the soft gate for positive advantages."""
    tau_neg: float = Field(1.05, gt=0)
    """loss_mode sapo: temperature of the soft gate for the other advantages (above tau_pos for asymmetry)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight: loss -= entropy_coeff * entropy."""
    use_kl_loss: bool = False
    """Add a KL penalty against the reference policy to the loss (GRPO); needs ref_log_probs in UpdatePolicy."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3); a "+" suffix takes k2's gradient."""
    router_aux_loss_coef: float = Field(0.0, ge=0)
    """Mixture-of-experts models only: weight of the router's load-balancing loss (Switch Transformer's, as
    transformers computes it over the non-padding tokens) added to the policy loss; reported as
    actor/router_aux_loss. 0 = off: the RL loss alone. The models' own configs give e.g. 0.001 (Qwen3-MoE's
    router_aux_loss_coef). A model without a router refuses a non-zero value."""
    router_replay: bool = False
    """Mixture-of-experts models only: MoE routing replay (R3). The rollout engine records the experts each MoE
    layer chose for every token, and the actor's forward passes (old log-probs and updates) route each token
    to those instead of choosing again, so the trainer evaluates the network that sampled; the routing
    weights stay the trainer's. Reports actor/router_agreement: the fraction of recorded routes the trainer
    would have chosen itself. rollout.engine hf only (why not vLLM here: docs/moe.md); with
    use_remove_padding the routes are packed with their tokens; multi-turn and agent samples join their engine
    calls' routes as their token ids (docs/moe.md)."""
    lora: LoraConfig = LoraConfig()
    """LoRA: train low-rank adapters only. The reference's log-probs then come from the actor with its
    adapters off (no reference service runs), and checkpoints hold the adapters and their optimizer."""

    @model_validator(mode="before")
    @classmethod
    def _loss_mode_aggregation(cls, data: Any) -> Any:
        """loss_agg_mode left out takes the loss mode's own default (LOSS_MODE_AGGREGATION)."""
        if isinstance(data, dict) and "loss_agg_mode" not in data and data.get("loss_mode") in LOSS_MODE_AGGREGATION:
            data = {**data, "loss_agg_mode": LOSS_MODE_AGGREGATION[data["loss_mode"]]}
        return data

    @model_validator(mode="after")
    def _loss_mode_settings(self) -> ActorConfig:
        if self.loss_mode == "dro" and self.dro_beta is None:
            raise ValueError("loss_mode dro needs dro_beta, the weight of its log-ratio penalty (> 0)")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb {self.clip_cov_lb} must be below clip_cov_ub {self.clip_cov_ub}")
        return self


class ReferenceConfig(ModelRoleSection):
    """The reference: the frozen policy's log-probs for KL terms, and its optional periodic reset."""

    enable: bool = True
    """Run a reference service (needed for KL in reward or KL loss)."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Rows per forward on one rank in ComputeLogProbs."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget (rows x padded length) per micro-batch on one rank; 0 = fixed row counts."""
    sync_ref_model: bool = False
    """Reset the reference to the policy every ref_model_sync_steps steps (TRL's sync_ref_model, from TR-DPO): after
    that step's actor update the actor sends its weights to the reference over a weight-sync group of their own,
    which the reference mixes in by ref_model_mixup_alpha. Needs a reference service (a KL term and no actor.lora)
    and a weight_sync.transport other than grpc. Checkpoints do not hold the reference: a resumed run's reference is
    model.path's until its next reset."""
    ref_model_sync_steps: int = Field(512, ge=1)
    """With sync_ref_model: steps between two resets (TR-DPO's tau; TRL's default)."""
    ref_model_mixup_alpha: float = Field(0.6, gt=0, le=1)
    """How the reference takes the weights a sync sends it (TR-DPO's alpha; TRL's default): ref = alpha * sent +
    (1 - alpha) * ref; 1 = the sent weights as they are."""


class TeacherConfig(ModelRoleSection):
    """The teacher of on-policy distillation (algorithm.distill): a frozen model that scores the student's
    sampled tokens, served like the reference (log-probs only) from a model of its own, in its own pool."""

    model_path: str = ""
    """Teacher model directory (a Hugging Face model); its tokenizer must be the policy's (model.path): the
    same vocabulary, ids and special tokens, checked before the run. Needed with algorithm.distill.enable."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Rows per forward on one rank in ComputeLogProbs."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget (rows x padded length) per micro-batch on one rank; 0 = fixed row counts."""


class CriticConfig(ModelRoleSection):
    """The critic: the value model's optimizer, batch sizes and value loss (GAE only)."""

    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    model_path: str = ""
    """Critic model directory; empty = model.path (the policy's backbone, with a new value head)."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW (decoupled) weight decay."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear LR warmup over this many updates (UpdateValues calls), then constant; 0 = constant."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this; a non-finite norm skips the optimizer step."""
    ppo_mini_batch_size: int = Field(8, ge=1)
    """Prompts per optimizer step, summed over ranks (VeRL's meaning: rows = this * rollout.n)."""
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    """Rows per forward/backward on one rank; gradients accumulate over micro-batches."""
    forward_micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Rows per forward on one rank in ComputeValues."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget (rows x padded length) per micro-batch on one rank; 0 = fixed row counts above."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the batch per UpdateValues."""
    cliprange_value: float = Field(0.5, ge=0)
    """Value clip: new values stay within old values +- this in the clipped loss term."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token value losses reduce to one number."""
