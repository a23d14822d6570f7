"""RunConfig: the whole run config, its sections, and the rules between them."""

from __future__ import annotations

from pydantic import model_validator

from rlfabric.core.config.actor import ActorConfig, CriticConfig, ReferenceConfig, TeacherConfig
from rlfabric.core.config.agent import AgentConfig
from rlfabric.core.config.algorithm import AlgorithmConfig
from rlfabric.core.config.base import Section
from rlfabric.core.config.env import EnvConfig
from rlfabric.core.config.launcher import LauncherConfig, ResourcePoolConfig
from rlfabric.core.config.model import DataConfig, ModelConfig
from rlfabric.core.config.reward import RewardConfig
from rlfabric.core.config.rollout import JudgePoolConfig, RolloutConfig
from rlfabric.core.config.server import (
    ClientConfig,
    ClusterConfig,
    ServerConfig,
    StorageConfig,
    TracingConfig,
)
from rlfabric.core.config.sim import SimConfig
from rlfabric.core.config.trainer import TrainerConfig
from rlfabric.core.config.weight_sync import ADAPTER_ENGINES, WeightSyncConfig
from rlfabric.core.roles import POOL_ROLES, ROLES, TRAINER_ROLES

# Attention backends that separate packed sequences: sdpa and eager by the positions (a causal, same-sequence
# mask), flash attention by its variable-length path. Not flex_attention: no backward on CPU.
PACKING_BACKENDS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


AGENT_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")


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
    teacher: TeacherConfig = TeacherConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    judge: JudgePoolConfig = JudgePoolConfig()
    env: EnvConfig = EnvConfig()
    agent: AgentConfig = AgentConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    storage: StorageConfig = StorageConfig()
    launcher: LauncherConfig = LauncherConfig()
    tracing: TracingConfig = TracingConfig()
    sim: SimConfig = SimConfig()
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
    def _packing_has_a_backend(self) -> RunConfig:
        """<role>.use_remove_padding needs an attention backend that keeps packed sequences apart."""
        packing = [f"{role}.use_remove_padding" for role in TRAINER_ROLES
                   if getattr(self, role).use_remove_padding]
        backend = self.model.attn_implementation
        if packing and backend not in PACKING_BACKENDS:
            raise ValueError(f"{packing[0]} with model.attn_implementation {backend!r}: packed sequences need an "
                             f"attention backend that keeps them apart ({', '.join(PACKING_BACKENDS)}); set one, or "
                             f"turn {packing[0]} off")
        return self

    @model_validator(mode="after")
    def _trainer_tensor_parallel_fits(self) -> RunConfig:
        """<role>.tensor_parallel_size divides the role's world_size, and the actor's LoRA adapters are not split."""
        for role in TRAINER_ROLES:
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
        """The reward workers, the python tool's calls and agents never share a uid (signals and RLIMIT_NPROC go by
        uid)."""
        reward, python = self.reward.custom_sandbox, self.env.python.sandbox
        if reward.uid < python.uid + python.uid_count and python.uid < reward.uid + reward.uid_count:
            raise ValueError(
                f"reward.custom_sandbox's uids ({reward.uid}..{reward.uid + reward.uid_count - 1}) overlap "
                f"env.python.sandbox's ({python.uid}..{python.uid + python.uid_count - 1}): keep them apart")
        agent = self.agent
        for name, other in (("reward.custom_sandbox", reward), ("env.python.sandbox", python)):
            if agent.uid < other.uid + other.uid_count and other.uid < agent.uid + agent.uid_count:
                raise ValueError(
                    f"agent.uid's range ({agent.uid}..{agent.uid + agent.uid_count - 1}) overlaps {name}'s "
                    f"({other.uid}..{other.uid + other.uid_count - 1}): keep them apart")
        if self.reward.num_workers > reward.uid_count:
            raise ValueError(f"reward.num_workers {self.reward.num_workers} > reward.custom_sandbox.uid_count "
                             f"{reward.uid_count}: each worker needs a uid of its own")
        return self

    @model_validator(mode="after")
    def _judge_pool_is_its_own(self) -> RunConfig:
        """The judge's replicas are not the policy's: those receive every weight sync, and the judge must not. A
        judge pool the launchers start (judge.model_path) is the one reward.judge.addresses names."""
        judge = self.reward.judge
        shared = sorted(set(judge.addresses) & set(self.cluster.rollout))
        if shared:
            raise ValueError(f"reward.judge.addresses shares {shared} with cluster.rollout: the judge needs rollout "
                             "services of its own, serving the judge model (the policy's receive its weight syncs)")
        if self.judge.model_path and judge.addresses and judge.addresses != self.cluster.judge:
            raise ValueError("reward.judge.addresses with judge.model_path: the launchers start the judge pool and "
                             "write its addresses there; give judge.model_path (a pool they start) or "
                             "reward.judge.addresses (services you started), not both")
        if self.judge.tensor_parallel_size > 1 and self.judge.engine != "vllm":
            raise ValueError(f"judge.tensor_parallel_size {self.judge.tensor_parallel_size} needs judge.engine vllm "
                             f"(the {self.judge.engine} engine runs one process per replica)")
        return self

    @model_validator(mode="after")
    def _judge_does_not_overlap(self) -> RunConfig:
        """The judge takes its own data sources: with another scorer configured, one of them lists its sources,
        and they share none."""
        reward, judge = self.reward, self.reward.judge
        if not self.has_judge():
            if judge.data_sources:
                raise ValueError("reward.judge.data_sources is set but there is no judge: set judge.model_path (a "
                                 "pool the launchers start) or reward.judge.addresses")
            return self
        others = {key: sources for key, sources, path in (("reward.custom_sources", reward.custom_sources,
                                                           reward.custom_path),
                                                          ("reward.model_sources", reward.model_sources,
                                                           reward.model_path))
                  if path}
        for key, sources in others.items():
            if not sources and not judge.data_sources:
                raise ValueError(f"the judge and {key.replace('_sources', '_path')} would both score every item: "
                                 f"list the data sources of one of them in reward.judge.data_sources or {key}")
            shared = sorted(set(sources) & set(judge.data_sources))
            if shared:
                raise ValueError(f"reward.judge.data_sources and {key} share {shared}: each data_source goes to one "
                                 "scorer")
        return self

    @model_validator(mode="after")
    def _agents_train_by_outcome(self) -> RunConfig:
        """An agent run's episodes have one reward each, shared by their segments: an outcome estimator."""
        if not self.agent.runs_agents():
            return self
        key = {"command": "agent.command", "service": "agent.address"}.get(self.agent.runner, "agent.entrypoint")
        if self.algorithm.adv_estimator not in AGENT_ESTIMATORS:
            raise ValueError(f"{key} with algorithm.adv_estimator {self.algorithm.adv_estimator}: an episode's "
                             f"reward is shared by its segments, which needs an outcome estimator "
                             f"({', '.join(AGENT_ESTIMATORS)})")
        if self.algorithm.use_kl_in_reward:
            raise ValueError(f"{key} with algorithm.use_kl_in_reward: not for agent episodes; use actor.use_kl_loss")
        if self.rollout.multi_turn.enable:
            raise ValueError(f"{key} with rollout.multi_turn.enable: an episode is either the agent's (through the "
                             "gateway) or the environment service's; turn one off")
        return self

    @model_validator(mode="after")
    def _sim_trainers_are_one_process(self) -> RunConfig:
        """A simulated trainer is one process whatever the GPUs it models (sim.trainer.gpus)."""
        for role in TRAINER_ROLES:
            section = getattr(self, role)
            if section.engine == "sim" and (section.world_size > 1 or section.tensor_parallel_size > 1):
                raise ValueError(f"{role}.engine sim with {role}.world_size {section.world_size} and "
                                 f"tensor_parallel_size {section.tensor_parallel_size}: a simulated trainer runs as "
                                 "one process; set the GPUs it models with sim.trainer.gpus")
        return self

    @model_validator(mode="after")
    def _distill_has_a_teacher(self) -> RunConfig:
        """Distillation needs a teacher; alone (no task reward) it needs no critic. With agent episodes it works
        as with single-turn samples: the teacher scores each segment's tokens as the gateway recorded them (one
        tokenizer, checked), and the tokens the model did not write (tool results, user turns) are off the
        train mask, so they carry no reverse KL."""
        distill = self.algorithm.distill
        if distill.enable and not self.teacher.model_path:
            raise ValueError("algorithm.distill.enable needs teacher.model_path: the teacher model's directory (its "
                             "tokenizer must be model.path's)")
        if distill.enable and not distill.use_task_reward and self.algorithm.adv_estimator == "gae":
            raise ValueError("algorithm.distill.use_task_reward false with algorithm.adv_estimator gae: the teacher's "
                             "per-token signal replaces the advantages, so the critic would learn values of no "
                             "reward (its returns would be the reverse KL, which needs no baseline); set "
                             "algorithm.distill.use_task_reward true to add the task reward's GAE, or another "
                             "adv_estimator (e.g. grpo), which runs no critic")
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

    def uses_teacher(self) -> bool:
        """On-policy distillation: a teacher service scores the student's samples."""
        return self.algorithm.distill.enable

    def uses_judge_pool(self) -> bool:
        """The launchers start a judge pool (judge.model_path) and point reward.judge.addresses at it."""
        return bool(self.judge.model_path)

    def has_judge(self) -> bool:
        """The reward service calls a generative judge: the launchers' pool, or services named by hand."""
        return self.uses_judge_pool() or bool(self.reward.judge.addresses)

    def roles_in_use(self) -> list[str]:
        """The roles a run of this config calls, in start order: the launchers start only these."""
        optional = {"reference": self.uses_reference(), "critic": self.uses_critic(), "teacher": self.uses_teacher(),
                    "judge": self.uses_judge_pool(), "env": self.env.enable}
        return [role for role in ROLES if optional.get(role, True)]
