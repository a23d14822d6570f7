"""VeRL's and TRL's names for what rlfabric's config sets: the one table behind the hints in config errors
(`trainer.total_epochs: VeRL's key; use trainer.total_steps`) and docs/coming-from-verl-trl.md.

    verl_hint("trainer.total_epochs")   # "VeRL's key; use trainer.total_steps (...)"

A row names the rlfabric key that does the same (tests check that it exists), or says why there is none.
Only keys that differ are here: VeRL's data.train_files, algorithm.adv_estimator, trainer.save_freq and the
like are rlfabric's keys too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyRow:
    """One of another framework's keys and what rlfabric has for it."""

    theirs: str
    """Their name: VeRL's dotted YAML key, or a TRL GRPOConfig field."""
    ours: str = ""
    """The rlfabric key that does the same; empty when there is none."""
    note: str = ""
    """What differs, or why rlfabric has no such key."""

    def hint(self, framework: str) -> str:
        """What a config error says about `theirs`."""
        if not self.ours:
            return f"{framework}'s key; {self.note}"
        return f"{framework}'s key; use {self.ours}" + (f" ({self.note})" if self.note else "")


_AR = "actor_rollout_ref"
VERL_KEYS: tuple[KeyRow, ...] = (
    KeyRow("trainer.total_epochs", "trainer.total_steps",
           "rlfabric counts steps: epochs x training rows / data.train_batch_size"),
    KeyRow("trainer.total_training_steps", "trainer.total_steps"),
    KeyRow("trainer.logger", "trainer.loggers"),
    KeyRow("trainer.default_local_dir", "trainer.run_dir", "checkpoints go to RUN_DIR/checkpoints"),
    KeyRow("trainer.resume_mode", "trainer.resume"),
    KeyRow("trainer.n_gpus_per_node", "resource_pools.<name>.gpus",
           "or nothing: the local launcher gives the roles every visible GPU"),
    KeyRow("trainer.nnodes", "resource_pools.<name>.nodes"),
    KeyRow("trainer.critic_warmup", note="no equivalent: the critic and the actor update from the first step"),
    KeyRow("trainer.balance_batch", note="no equivalent: batches are split by tokens "
                                         "(actor.max_tokens_per_micro_batch)"),
    KeyRow("trainer.default_hdfs_dir", note="no equivalent: checkpoints stay in trainer.run_dir"),
    KeyRow("data.prompt_key", note="no equivalent: prompts are the `prompt` column; `rlfabric data` writes "
                                   "other files in VeRL's schema"),
    KeyRow("data.reward_fn_key", note="no equivalent: the `data_source` column picks the scorer"),
    KeyRow("data.shuffle", "data.seed", "data is always shuffled, per epoch, with this seed"),
    KeyRow("data.gen_batch_size", "algorithm.filter_groups.max_num_gen_batches",
           "dynamic sampling draws data.train_batch_size prompts at a time"),
    KeyRow(f"{_AR}.model.path", "model.path"),
    KeyRow(f"{_AR}.model.trust_remote_code", "model.trust_remote_code"),
    KeyRow(f"{_AR}.model.enable_gradient_checkpointing", "model.gradient_checkpointing"),
    KeyRow(f"{_AR}.model.use_remove_padding", "actor.use_remove_padding", "one per model role"),
    KeyRow(f"{_AR}.model.lora_rank", "actor.lora.rank"),
    KeyRow(f"{_AR}.model.lora_alpha", "actor.lora.alpha"),
    KeyRow(f"{_AR}.model.target_modules", "actor.lora.target_modules"),
    KeyRow(f"{_AR}.hybrid_engine", "trainer.colocated"),
    KeyRow(f"{_AR}.actor.optim.lr", "actor.lr"),
    KeyRow(f"{_AR}.actor.optim.weight_decay", "actor.weight_decay"),
    KeyRow(f"{_AR}.actor.optim.lr_warmup_steps", "actor.lr_warmup_steps"),
    KeyRow(f"{_AR}.actor.grad_clip", "actor.grad_clip"),
    KeyRow(f"{_AR}.actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    KeyRow(f"{_AR}.actor.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_gpu"),
    KeyRow(f"{_AR}.actor.ppo_max_token_len_per_gpu", "actor.max_tokens_per_micro_batch"),
    KeyRow(f"{_AR}.actor.use_dynamic_bsz", "actor.max_tokens_per_micro_batch", "> 0 turns it on"),
    KeyRow(f"{_AR}.actor.ppo_epochs", "actor.ppo_epochs"),
    KeyRow(f"{_AR}.actor.clip_ratio", "actor.clip_ratio_low", "and actor.clip_ratio_high"),
    KeyRow(f"{_AR}.actor.clip_ratio_low", "actor.clip_ratio_low"),
    KeyRow(f"{_AR}.actor.clip_ratio_high", "actor.clip_ratio_high"),
    KeyRow(f"{_AR}.actor.clip_ratio_c", "actor.clip_ratio_c"),
    KeyRow(f"{_AR}.actor.entropy_coeff", "actor.entropy_coeff"),
    KeyRow(f"{_AR}.actor.use_kl_loss", "actor.use_kl_loss"),
    KeyRow(f"{_AR}.actor.kl_loss_coef", "actor.kl_loss_coef"),
    KeyRow(f"{_AR}.actor.kl_loss_type", "actor.kl_loss_type"),
    KeyRow(f"{_AR}.actor.loss_agg_mode", "actor.loss_agg_mode"),
    KeyRow(f"{_AR}.actor.policy_loss.loss_mode", "actor.loss_mode"),
    *(KeyRow(f"{_AR}.actor.policy_loss.{key}", f"actor.{key}")
      for key in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")),
    KeyRow(f"{_AR}.actor.tau_pos", "actor.tau_pos"),
    KeyRow(f"{_AR}.actor.tau_neg", "actor.tau_neg"),
    KeyRow(f"{_AR}.actor.strategy", note="no equivalent: set actor.world_size and actor.tensor_parallel_size"),
    KeyRow(f"{_AR}.actor.ulysses_sequence_parallel_size", note="no equivalent: rlfabric has no sequence "
                                                               "parallelism; see actor.tensor_parallel_size"),
    KeyRow(f"{_AR}.ref.log_prob_micro_batch_size_per_gpu", "reference.log_prob_micro_batch_size_per_gpu"),
    KeyRow(f"{_AR}.rollout.name", "rollout.engine"),
    KeyRow(f"{_AR}.rollout.n", "rollout.n"),
    KeyRow(f"{_AR}.rollout.temperature", "rollout.temperature"),
    KeyRow(f"{_AR}.rollout.top_p", "rollout.top_p"),
    KeyRow(f"{_AR}.rollout.top_k", "rollout.top_k"),
    KeyRow(f"{_AR}.rollout.response_length", "rollout.response_length"),
    KeyRow(f"{_AR}.rollout.tensor_model_parallel_size", "rollout.tensor_parallel_size"),
    KeyRow(f"{_AR}.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    KeyRow(f"{_AR}.rollout.max_num_seqs", "rollout.max_num_seqs"),
    KeyRow(f"{_AR}.rollout.enforce_eager", "rollout.enforce_eager"),
    KeyRow(f"{_AR}.rollout.free_cache_engine", "rollout.enable_sleep_mode"),
    KeyRow(f"{_AR}.rollout.log_prob_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size_per_gpu",
           "the actor computes the old log-probs"),
    KeyRow(f"{_AR}.rollout.val_kwargs.temperature", "rollout.val_temperature"),
    KeyRow(f"{_AR}.rollout.val_kwargs.n", "rollout.val_n"),
    KeyRow(f"{_AR}.rollout.multi_turn.enable", "rollout.multi_turn.enable"),
    KeyRow(f"{_AR}.rollout.multi_turn.max_assistant_turns", "rollout.multi_turn.max_turns"),
    KeyRow("critic.optim.lr", "critic.lr"),
    KeyRow("critic.model.path", "critic.model_path"),
    KeyRow("critic.ppo_max_token_len_per_gpu", "critic.max_tokens_per_micro_batch"),
    KeyRow("reward_model.enable", "reward.model_path", "a reward model scores when its path is set"),
    KeyRow("reward_model.model.path", "reward.model_path"),
    KeyRow("reward_model.micro_batch_size_per_gpu", "reward.model_batch_size"),
    KeyRow("reward_model.reward_manager", note="no equivalent: the reward service routes items by data_source "
                                               "(reward.custom_sources, reward.model_sources)"),
    KeyRow("reward_model.overlong_buffer.enable", "reward.overlong_enable"),
    KeyRow("reward_model.overlong_buffer.len", "reward.overlong_buffer_length"),
    KeyRow("reward_model.overlong_buffer.penalty_factor", "reward.overlong_penalty_factor"),
    KeyRow("custom_reward_function.path", "reward.custom_path"),
    KeyRow("custom_reward_function.name", "reward.custom_name"),
    KeyRow("custom_reward_function.reward_kwargs", "reward.custom_kwargs"),
    KeyRow("algorithm.kl_ctrl.type", "algorithm.kl_ctrl_type"),
    KeyRow("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    KeyRow("algorithm.kl_ctrl.target_kl", "algorithm.kl_target"),
    KeyRow("algorithm.kl_ctrl.horizon", "algorithm.kl_horizon"),
    KeyRow("ray_init.num_cpus", "launcher.ray.<role>.num_cpus", "per role"),
)

# VeRL's sections that rlfabric splits or renames: what an unknown key under one of them hints when its row
# is not in VERL_KEYS.
VERL_SECTIONS = {
    _AR: "VeRL's section; rlfabric splits it into model, actor, reference and rollout "
         "(e.g. actor_rollout_ref.actor.optim.lr is actor.lr)",
    "reward_model": "VeRL's section; rlfabric's is reward (reward.model_path, reward.model_sources, ...)",
    "custom_reward_function": "VeRL's section; rlfabric's keys are reward.custom_path, reward.custom_name "
                              "and reward.custom_kwargs",
    "ray_init": "VeRL's section; rlfabric's Ray settings are launcher.ray",
}

# TRL's GRPOConfig fields (Python keyword arguments, not YAML) and the rlfabric key of each.
TRL_GRPO_KEYS: tuple[KeyRow, ...] = (
    KeyRow("learning_rate", "actor.lr"),
    KeyRow("weight_decay", "actor.weight_decay"),
    KeyRow("warmup_steps", "actor.lr_warmup_steps"),
    KeyRow("max_grad_norm", "actor.grad_clip"),
    KeyRow("max_steps", "trainer.total_steps"),
    KeyRow("num_train_epochs", "trainer.total_steps", "rlfabric counts steps"),
    KeyRow("per_device_train_batch_size", "actor.ppo_micro_batch_size_per_gpu",
           "TRL counts completions; rlfabric counts prompts in data.train_batch_size"),
    KeyRow("gradient_accumulation_steps", "actor.ppo_mini_batch_size",
           "mini-batch / micro-batch is the accumulation"),
    KeyRow("num_generations", "rollout.n"),
    KeyRow("max_prompt_length", "data.max_prompt_length"),
    KeyRow("max_completion_length", "data.max_response_length"),
    KeyRow("temperature", "rollout.temperature"),
    KeyRow("top_p", "rollout.top_p"),
    KeyRow("top_k", "rollout.top_k"),
    KeyRow("beta", "actor.kl_loss_coef", "with actor.use_kl_loss=true; 0 = no reference model"),
    KeyRow("epsilon", "actor.clip_ratio_low"),
    KeyRow("epsilon_high", "actor.clip_ratio_high"),
    KeyRow("num_iterations", "actor.ppo_epochs"),
    KeyRow("loss_type", "actor.loss_agg_mode", "grpo = seq-mean-token-mean, dapo = token-mean"),
    KeyRow("importance_sampling_level", "actor.loss_mode", "sequence = gspo"),
    KeyRow("scale_rewards", "algorithm.norm_adv_by_std_in_grpo"),
    KeyRow("use_vllm", "rollout.engine", "vllm"),
    KeyRow("vllm_gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    KeyRow("vllm_tensor_parallel_size", "rollout.tensor_parallel_size"),
    KeyRow("gradient_checkpointing", "model.gradient_checkpointing"),
    KeyRow("output_dir", "trainer.run_dir"),
    KeyRow("save_steps", "trainer.save_freq"),
    KeyRow("report_to", "trainer.loggers"),
    KeyRow("seed", "data.seed", "and rollout.seed"),
    KeyRow("reward_funcs", "reward.custom_path", "a Python file holding the function reward.custom_name names"),
)

_VERL_ROWS = {row.theirs: row for row in VERL_KEYS}


def verl_hint(key: str) -> str | None:
    """What to say about `key` (dotted) when it is one of VeRL's keys in VERL_KEYS; None otherwise."""
    row = _VERL_ROWS.get(key)
    return row.hint("VeRL") if row is not None else None


def key_table_markdown(rows: tuple[KeyRow, ...], their_name: str) -> str:
    """A Markdown table of rows: their key, rlfabric's, the note (docs/coming-from-verl-trl.md)."""
    lines = [f"| {their_name} | rlfabric | note |", "| --- | --- | --- |"]
    for row in rows:
        ours = f"`{row.ours}`" if row.ours else "-"
        lines.append(f"| `{row.theirs}` | {ours} | {row.note} |")
    return "\n".join(lines) + "\n"
