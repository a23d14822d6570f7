"""trainer: the run (steps, checkpoints, loggers, mode) and the experiment trackers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.core.config.base import Section


class MlflowConfig(Section):
    """The mlflow logger of trainer.loggers (extra `trackers`)."""

    tracking_uri: str = ""
    """MLflow tracking store (sqlite:///path.db, http://host:5000, ...); empty = the MLFLOW_TRACKING_URI
    environment variable, else sqlite:///RUN_DIR/mlflow.db. Only the mesh's own config sets it: a StartRun
    cannot (a file anywhere, or an address the coordinator would send requests to)."""


class WandbConfig(Section):
    """The wandb logger of trainer.loggers (extra `trackers`)."""

    mode: Literal["offline", "online"] = "offline"
    """offline = the run is written to RUN_DIR/wandb only (upload it later with `wandb sync`); online = it
    streams to the W&B server too (needs WANDB_API_KEY)."""
    entity: str = ""
    """W&B team or user the run belongs to; empty = the API key's default entity."""


class TrainerConfig(Section):
    """The run: steps, sync or async mode, validation, checkpoints, loggers and the final model."""

    total_steps: int = Field(20, ge=1)
    """PPO steps to run."""
    project_name: str = "rlfabric"
    """Grouping name for loggers: the mlflow experiment and the wandb project (the run is named after
    trainer.experiment_name, else the run dir)."""
    mode: Literal["sync", "async"] = "sync"
    """sync: on-policy steps (generation waits for each weight sync); async: generation streams on while the
    trainer trains, up to max_staleness steps ahead."""
    max_staleness: int = Field(1, ge=0)
    """async: most weight versions the oldest token of a sample may lag the policy trained on it; generation
    runs up to this many steps ahead of training (0 = as sync). Samples past it are dropped, never trained on."""
    colocated: bool = False
    """The hybrid engine: the rollout shares devices with the trainers (one resource pool). After generating it
    sleeps (level 2, or 1 with LoRA adapter syncs); before the weight sync its weights wake, after it its KV
    cache (VeRL's order); memory/rollout/* report each phase's memory (memory/actor/* the actor's around its
    update, in every run). Needs trainer.mode sync."""
    test_freq: int = Field(0, ge=0)
    """Validate on data.val_files every this many steps (and after the last); 0 = never."""
    val_before_train: bool = False
    """Validate once before the first step."""
    save_freq: int = Field(0, ge=0)
    """Checkpoint every this many steps (and after the last); 0 = only at the end (trainer.save_final),
    on SaveCheckpoint and when the run is stopped."""
    save_final: bool = True
    """Checkpoint after the last step, so that every run keeps its trained policy and can be resumed."""
    export_final: bool = True
    """After the last step (or a stop that saved), export the policy as a Hugging Face directory
    (weights, tokenizer, chat template) to RUN_DIR/final_model, loadable by transformers and vLLM."""
    resume: Literal["auto", "disable"] = "auto"
    """auto: continue from the latest checkpoint in the run dir, if any; disable: always start fresh."""
    resume_from_path: str = ""
    """A checkpoint directory (global_step_N) to resume from; overrides resume: auto."""
    max_checkpoints_to_keep: int = Field(0, ge=0)
    """Delete older global_step_N directories beyond this many; 0 = keep all."""
    loggers: list[Literal["console", "jsonl", "tensorboard", "mlflow", "wandb"]] = ["console", "jsonl", "tensorboard"]
    """Metric sinks: console lines, RUN_DIR/metrics.jsonl, TensorBoard events in RUN_DIR/tensorboard, and the
    experiment trackers mlflow (trainer.mlflow) and wandb (trainer.wandb), which need the extra `trackers`
    (pip install 'rlfabric[trackers]'): the metrics by step, the config as parameters, curves.png and the
    final model's path."""
    mlflow: MlflowConfig = MlflowConfig()
    """The mlflow logger's tracking store."""
    wandb: WandbConfig = WandbConfig()
    """The wandb logger's mode and entity."""
    progress_bar: bool = True
    """Show a progress bar with step, reward and ETA."""
    plot: bool = True
    """Write RUN_DIR/curves.png (reward, KL, response length) at the end of the run."""
    rollout_retries: int = Field(2, ge=0)
    """Times a failed generation part is retried on another rollout replica before the step fails."""
    rollout_hedge_after: float = Field(0.0, ge=0)
    """Hedged generation: once half of a step's generation parts have finished, a part still running after this
    many times their median duration is sent once more, its missing samples only, to another rollout replica;
    the first copy of each sample wins (rollout/router/hedges). Cuts the wait on a stalled link, a hung or a
    straggling replica to about this many parts' time. 0 = off; 2-4 at scale."""
    reward_retry_window_s: float = Field(120.0, ge=0)
    """How long scoring keeps retrying an unreachable (e.g. restarting) reward service, with backoff,
    before the step fails; a missed deadline (client.timeout_s) is retried once."""
    run_dir: str = ""
    """Where the run writes metrics, rollouts and checkpoints; empty = runs/<name> (the launchers set it)."""
    experiment_name: str = Field("", pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,99})?$")
    """Keeps runs on one mesh apart: non-empty = this run's metrics, rollouts and checkpoints go to
    RUN_DIR/experiments/<name> (a new name starts fresh, the same name resumes). StartRun may set it,
    not trainer.run_dir."""
    dump_rollouts: bool = True
    """Write every step's prompts, responses, scores and weight versions to RUN_DIR/rollouts/step_N.jsonl."""
    dump_rollout_tokens: bool = False
    """With dump_rollouts: each sample's prompt_ids, response_ids and the sampler's rollout_log_probs too (to
    replay a step in another trainer, as bench.first_update_bench does); off by default, as they are large."""
