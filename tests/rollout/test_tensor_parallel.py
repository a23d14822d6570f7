"""rollout.tensor_parallel_size without starting an engine: the settings that cannot work are refused naming the
key (an engine without TP, a pool whose GPUs do not split into replicas, a model whose heads do not split), the
replicas of a pool split its devices, `rlfabric up --dry-run` shows the layout, the Helm chart gives each rollout
pod its TP GPUs, and vLLM's CPU workers get cores of their own on a host with one NUMA node.
(tests/rollout/test_tensor_parallel_vllm.py runs a TP=2 vLLM replica.)"""

from __future__ import annotations

import json
import shutil

import pytest

from rlfabric import cli
from rlfabric.core.config import ConfigError, load_config
from rlfabric.launch.local import service_names
from rlfabric.launch.placement import describe_placement, plan_placement
from rlfabric.rollout.tensor_parallel import check_model_splits, cpu_binding

pytestmark = pytest.mark.slow

TP2 = ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"]
# SmolLM2-135M's attention: 9 heads, 3 KV heads (tests/real_model/test_smollm2_tensor_parallel.py runs it at TP=3).
SMOLLM2_HEADS = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}


def _rlfabric(capsys, *args: str) -> int:
    """`rlfabric ARGS` in this process (its CLI's main): the exit code."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    return exited.value.code


@pytest.mark.parametrize("engine, why", [
    ("hf", "the hf engine runs one process per replica"),
    ("sglang", "an SGLang server's tensor parallelism is its own --tp-size"),
])
def test_an_engine_without_tensor_parallelism_is_refused_naming_the_key(engine, why):
    with pytest.raises(ConfigError, match=rf"rollout.tensor_parallel_size 2 needs rollout.engine vllm; {engine} has "
                                          rf"none here \({why}"):
        load_config(None, [f"rollout.engine={engine}", "rollout.tensor_parallel_size=2"])


@pytest.mark.parametrize("pool", ["{gpus: 3}", "{devices: [0, 1, 2]}", "{gpus: 1, nodes: 2}"])
def test_a_tp_size_that_does_not_divide_the_pools_gpus_per_node_is_refused(pool):
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size 2 does not divide resource_pools.infer's "
                                          r"\d GPU\(s\) per node"):
        load_config(None, [*TP2, f"resource_pools={{infer: {pool}}}", "rollout.pool=infer"])


def test_the_replicas_of_a_pool_split_its_devices_and_the_dry_run_says_how():
    config = load_config(None, [*TP2, "resource_pools={train: {gpus: 1}, infer: {gpus: 4}}", "actor.pool=train",
                                "rollout.pool=infer", "rollout.replicas=3"])
    placements = plan_placement(config, service_names(config))
    # pool infer is GPUs 1-4: two replicas of two GPUs; a third shares the first slice, as replicas beyond a
    # pool's devices do with tensor_parallel_size 1.
    assert [placements[f"rollout-{i}"].gpus for i in range(3)] == [(1, 2), (3, 4), (1, 2)]
    assert placements["rollout-1"].env()["CUDA_VISIBLE_DEVICES"] == "3,4"
    assert ("rollout: tensor_parallel_size 2: 3 replica(s) of 2 GPUs each; pool infer's 4 GPUs hold 2; 1 more share "
            "them. Weight sync reaches each replica's TP rank 0, which forwards to its TP peers"
            in describe_placement(config, placements).splitlines())


def _model_with_heads(tiny_model, directory, **shape):
    """A copy of the tiny model's config and tokenizer with another attention shape (no weights: nothing loads it)."""
    directory.mkdir()
    for path in tiny_model.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, directory / path.name)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **shape}))
    return directory


def test_a_model_whose_heads_do_not_split_is_refused_before_anything_starts(tiny_model, tmp_path, capsys):
    model = _model_with_heads(tiny_model, tmp_path / "nine-heads", **SMOLLM2_HEADS)
    message = (f"rollout.tensor_parallel_size 2: the model's 9 attention heads do not divide by 2 ({model}); "
               "tensor_parallel_size values this model takes: 1, 3")
    with pytest.raises(ConfigError) as refused:
        check_model_splits(load_config(None, [*TP2, f"model.path={model}"]))
    assert str(refused.value) == message
    assert _rlfabric(capsys, "up", "--dry-run", *TP2, f"model.path={model}") == 1
    assert f"rlfabric: the rollout replicas cannot start: {message}" in capsys.readouterr().out
    assert _rlfabric(capsys, "train", "--run-dir", str(tmp_path / "run"), *TP2, f"model.path={model}") == 2
    assert capsys.readouterr().err.endswith(f"rlfabric: {message}\n")  # before any service started
    assert not (tmp_path / "run" / "endpoints.json").exists()


@pytest.mark.parametrize("shape, tp, problem", [
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, 4, ""),  # vLLM replicates each KV head on 2 ranks
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, 3, "the model's 4 KV heads do not divide by 3"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2}, 8, ""),
    ({"num_attention_heads": 12, "num_key_value_heads": 4}, 6, "6 is not a multiple of the model's 4 KV heads"),
    ({**SMOLLM2_HEADS}, 9, "the model's intermediate_size 1536 does not divide by 9"),
])
def test_kv_heads_split_as_vllm_splits_them(tiny_model, tmp_path, shape, tp, problem):
    model = _model_with_heads(tiny_model, tmp_path / "model", **shape)
    config = load_config(None, ["rollout.engine=vllm", f"rollout.tensor_parallel_size={tp}", f"model.path={model}"])
    if not problem:
        check_model_splits(config)
        return
    with pytest.raises(ConfigError, match=problem):
        check_model_splits(config)


@pytest.mark.parametrize("cpus, tp, numa_nodes, binding", [
    ([0, 1], 2, 1, "0|1"),  # this host: a core each, none left to keep back
    ([0, 1], 3, 1, "0|1|0"),  # fewer cores than ranks: shared
    (list(range(16)), 2, 1, "0-6|7-13"),  # one core per rank kept back for vLLM's engine process, as its auto mode
    ([4, 5, 6, 9], 2, 1, "4|5"),
    (list(range(16)), 2, 2, None),  # a NUMA node per rank: vLLM's own binding
    ([0, 1], 1, 1, None),
])
def test_cpu_workers_get_cores_of_their_own_where_vllm_auto_binding_cannot(cpus, tp, numa_nodes, binding):
    assert cpu_binding(cpus, tp, numa_nodes) == binding


def test_a_ray_replica_asks_for_its_tp_gpus():
    ray_placement = pytest.importorskip("rlfabric.launch.ray_placement")
    assert ray_placement.default_num_gpus(load_config(None, TP2), "rollout") == 2
    assert ray_placement.default_num_gpus(load_config(None, []), "rollout") == 1
