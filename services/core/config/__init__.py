"""The run config: one YAML file with a section per role, VeRL-style names, validated on load.

Sections: server, client, cluster, model, data, actor, reference, critic, teacher, rollout, judge, reward, env, agent,
algorithm, trainer, weight_sync, storage, launcher, tracing, sim, resource_pools. Every field has a default and a docstring
(`rlfabric config-reference`
prints them). Unknown keys and wrong types are errors that name the dotted key.

    config = load_config("my.yaml", overrides=["trainer.total_steps=20", "rollout.n=4"])

The built-in default (`rlfabric/quickstart/quickstart.yaml`) is the quickstart.
"""


from __future__ import annotations

from rlfabric.core.config.actor import ActorConfig, CriticConfig, LoraConfig, ReferenceConfig, TeacherConfig
from rlfabric.core.config.agent import AgentConfig, GatewayConfig
from rlfabric.core.config.algorithm import AlgorithmConfig, FilterGroupsConfig, RolloutCorrectionConfig
from rlfabric.core.config.base import DEFAULT_CONFIG_NAME, LOSS_MODE_AGGREGATION, ConfigError, Section
from rlfabric.core.config.env import EnvConfig, PythonToolConfig
from rlfabric.core.config.launcher import (
    LauncherConfig,
    RayLauncherConfig,
    RayResources,
    ResourcePoolConfig,
)
from rlfabric.core.config.loading import (
    apply_override,
    check_run_rules,
    config_from_dict,
    default_config_path,
    dump_config,
    import_named_modules,
    load_config,
    load_run_config,
    parse_override,
    read_auth_token,
    read_env_token,
    read_named_file,
    run_dir_of,
    set_key,
)
from rlfabric.core.config.model import DataConfig, ModelConfig
from rlfabric.core.config.reference import config_reference
from rlfabric.core.config.reward import CustomSandboxConfig, JudgeConfig, PythonSandboxConfig, RewardConfig
from rlfabric.core.config.rollout import JudgePoolConfig, MultiTurnConfig, RolloutConfig
from rlfabric.core.config.run import RunConfig
from rlfabric.core.config.server import (
    ClientConfig,
    ClusterConfig,
    ServerConfig,
    StorageConfig,
    TlsConfig,
    TracingConfig,
)
from rlfabric.core.config.sim import SimConfig, SimRolloutConfig, SimTrainerConfig
from rlfabric.core.config.trainer import MlflowConfig, TrainerConfig, WandbConfig
from rlfabric.core.config.weight_sync import ADAPTER_ENGINES, WeightSyncConfig

__all__ = [
    "LOSS_MODE_AGGREGATION",
    "DEFAULT_CONFIG_NAME",
    "ConfigError",
    "Section",
    "TlsConfig",
    "ServerConfig",
    "SimConfig",
    "SimRolloutConfig",
    "SimTrainerConfig",
    "ClientConfig",
    "ClusterConfig",
    "ModelConfig",
    "DataConfig",
    "LoraConfig",
    "ActorConfig",
    "ReferenceConfig",
    "CriticConfig",
    "TeacherConfig",
    "JudgePoolConfig",
    "MultiTurnConfig",
    "RolloutConfig",
    "CustomSandboxConfig",
    "JudgeConfig",
    "PythonSandboxConfig",
    "RewardConfig",
    "RolloutCorrectionConfig",
    "PythonToolConfig",
    "EnvConfig",
    "GatewayConfig",
    "AgentConfig",
    "FilterGroupsConfig",
    "AlgorithmConfig",
    "MlflowConfig",
    "WandbConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "ADAPTER_ENGINES",
    "RayResources",
    "RayLauncherConfig",
    "StorageConfig",
    "TracingConfig",
    "LauncherConfig",
    "ResourcePoolConfig",
    "RunConfig",
    "default_config_path",
    "parse_override",
    "apply_override",
    "set_key",
    "config_from_dict",
    "load_config",
    "load_run_config",
    "check_run_rules",
    "read_named_file",
    "import_named_modules",
    "run_dir_of",
    "read_auth_token",
    "read_env_token",
    "dump_config",
    "config_reference",
]
