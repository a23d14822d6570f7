"""Tensor-parallel vLLM replicas (rollout.tensor_parallel_size): what must hold before one starts.

    check_model_splits(config)            # ConfigError naming the key when the model cannot be split T ways
    cpu_binding(cpus, tp, numa_nodes)     # VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU workers ("0|1"), or None

Heads: vLLM shards attention by head, so the heads must divide by T (a ValueError deep in vLLM's start-up
otherwise); KV heads divide by T, or with fewer KV heads than T, T must be a multiple of them (vLLM then
replicates each KV head on T / kv_heads ranks); the MLP's intermediate size divides by T. Checked from the
model directory's config.json before the engine boots (the launchers check it before anything starts).

CPU binding: vLLM's CPU backend binds TP rank i's OpenMP threads to NUMA node i ("auto"), so on a host with
fewer NUMA nodes than T it refuses to start ("Not enough allowed NUMA nodes"). There the replica's cores are
split into T explicit lists instead, keeping back one core per rank for vLLM's engine process as its auto mode
does on x86 when there are cores enough; with fewer cores than ranks the ranks share them.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlfabric.core.config import ConfigError, RunConfig
from rlfabric.core.host import index_ranges

KEY = "rollout.tensor_parallel_size"


def text_config(config: dict) -> dict:
    """The language model's part of a config.json (multimodal configs nest it under text_config)."""
    return config.get("text_config") or config


def model_split_problem(model_config: dict, tp: int) -> str:
    """Why a model of this config.json cannot be split over `tp` ranks ("" = it can)."""
    text = text_config(model_config)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    intermediate = text.get("intermediate_size")
    if heads and heads % tp:
        return f"the model's {heads} attention heads do not divide by {tp}"
    if kv_heads and kv_heads >= tp and kv_heads % tp:
        return f"the model's {kv_heads} KV heads do not divide by {tp}"
    if kv_heads and kv_heads < tp and tp % kv_heads:
        return f"{tp} is not a multiple of the model's {kv_heads} KV heads (vLLM replicates a KV head on whole ranks)"
    if isinstance(intermediate, int) and intermediate % tp:
        return f"the model's intermediate_size {intermediate} does not divide by {tp}"
    return ""


def check_model_splits(config: RunConfig) -> None:
    """ConfigError naming rollout.tensor_parallel_size when the rollout model cannot be split that many ways.
    Where the model's config.json cannot be read here (not a local directory), vLLM's own check decides."""
    tp = config.rollout.tensor_parallel_size
    path = Path(config.model.path or "") / "config.json"
    if tp == 1 or not path.is_file():
        return
    try:
        model_config = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # the model check of the launcher or engine reports an unreadable config
    problem = model_split_problem(model_config, tp)
    if problem:
        divisors = [t for t in range(1, 65) if not model_split_problem(model_config, t)]
        raise ConfigError(f"{KEY} {tp}: {problem} ({config.model.path}); tensor_parallel_size values this model "
                          f"takes: {', '.join(map(str, divisors[:8]))}")


def numa_node_count() -> int:
    """NUMA nodes of this machine (1 where the kernel shows none)."""
    return max(1, len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))))


def cpu_binding(cpus: list[int], tp: int, numa_nodes: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for a replica of `tp` CPU workers on `cpus`: None where vLLM's auto binding
    works (one NUMA node per rank); else one core list per rank joined by "|" (vLLM's manual form)."""
    if tp <= 1 or numa_nodes >= tp:
        return None
    cpus = sorted(cpus)
    if len(cpus) <= tp:  # a core per rank at most, shared round-robin when there are fewer cores than ranks
        return "|".join(str(cpus[rank % len(cpus)]) for rank in range(tp))
    reserved = min(tp, len(cpus) - tp)  # vLLM's auto mode keeps one core per rank for its engine process
    per_rank = (len(cpus) - reserved) // tp
    return "|".join(index_ranges(cpus[rank * per_rank:(rank + 1) * per_rank]) for rank in range(tp))
