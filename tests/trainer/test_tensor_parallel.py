"""<role>.tensor_parallel_size: FSDP2 x DTensor tensor parallelism (gloo on CPU, ranks started by the service)
computes and trains like one rank, checkpoints cross layouts both ways, a weight sync gathers each shard once
onto rank 0 alone, and models or settings it cannot split are refused naming the key."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from rlfabric.core.config import ConfigError
from rlfabric.launch.local import check_model
from rlfabric.trainer.engine import TrainerEngine
from rlfabric.trainer.tensor_parallel import check_model_split, split_problem
from tests.numerics import FLOAT64, assert_same_float32, assert_same_metric, assert_same_update
from tests.trainer.helpers import Served, make_batch, make_config

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # numerics: make test-kernels

TRAIN = {"lr": 1e-3, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "clip_ratio_high": 0.28}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-weight Llama with the tiny model's tokenizer: 4 heads, 2 KV heads (GQA), an untied LM head of
    100 rows, so every part of the plan is split (the tiny Qwen2 ties its head, which then stays whole)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlfabric.quickstart.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama") / "llama"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _train(served, batch):
    """Log-probs (and sum_pi_squared, from the gathered logits), then two updates (the second off-policy);
    returns the log-probs and sum_pi_squared, and the metrics."""
    outputs = served.run(served.client.compute_log_probs(batch, temperature=0.8, compute_sum_pi_squared=True))
    old = outputs["log_probs"]
    advantages = torch.linspace(-1.0, 1.0, batch["responses"].numel()).reshape(batch["responses"].shape)
    metrics = [served.run(served.client.update_policy({**batch, "old_log_probs": old, "advantages": advantages},
                                                      global_step=step)) for step in range(2)]
    return (old, outputs["sum_pi_squared"]), metrics


def _gather_on_rank_0(served, monkeypatch):
    """What a weight sync gathers (engine.policy_weights, on the engine's torch thread), with rank 0's
    collectives counted (torch's CommDebugMode: every c10d and functional collective, full_tensor's
    all-gathers among them) and its point-to-point receives recorded. The first gather exchanges where each
    rank's shards lie (one all-gather, counted here); the one measured is the next, as every later sync."""
    from torch.distributed.tensor.debug import CommDebugMode

    engine = served.service.engine

    def first_gather():
        with CommDebugMode() as comm:
            engine.policy_weights()
        return comm.get_total_counts()

    assert served.run(engine._run(first_gather)) == 1  # on the torch thread: dispatch modes are per thread
    received = []
    recv = torch.distributed.recv

    def recording_recv(tensor, src=None, *args, **kwargs):
        if tensor.is_floating_point():  # weights; the command's reply (the ranks' RNG states) is bytes and ints
            received.append((src, tensor.numel() * tensor.element_size()))
        return recv(tensor, src, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "recv", recording_recv)

    def gather():
        with CommDebugMode() as comm:
            weights = engine.policy_weights()
        return weights, comm.get_total_counts()

    weights, collectives = served.run(engine._run(gather))  # the torch thread: dispatch modes are per thread
    monkeypatch.setattr(torch.distributed, "recv", recv)
    return weights, collectives, received


def test_tensor_parallel_actor_trains_like_one_rank(tiny_llama, tmp_path, monkeypatch):
    # 4 ranks: 2 data-parallel groups x TP 2. 16 rows = 2 mini-batches of 4 prompts x n=2. In float64, so that the
    # bounds hold on every CPU's kernels (tests/numerics.py).
    batch = make_batch(rows=16, prompt_len=8, response_len=6, seed=5)
    config = {"n": 2, "rollout": {"temperature": 0.8}, "model": FLOAT64}
    with Served("actor", make_config(tiny_llama, actor=TRAIN, **config)) as one:
        one.run(one.client.save_checkpoint(tmp_path / "one-start"))
        (old_1, squares_1), metrics_1 = _train(one, batch)
        weights_1 = one.run(one.service.engine.gather_weights())
    tp = {**TRAIN, "world_size": 4, "tensor_parallel_size": 2}
    with Served("actor", make_config(tiny_llama, actor=tp, **config)) as four:
        assert four.run(four.client.get_status()).world_size == 4
        (old_4, squares_4), metrics_4 = _train(four, batch)
        weights_4, collectives, received = _gather_on_rank_0(four, monkeypatch)
        four.run(four.client.export_hf(tmp_path / "export"))
        four.run(four.client.save_checkpoint(tmp_path / "tp-trained"))
        trained_4 = four.run(four.client.compute_log_probs(batch))["log_probs"]
        # A one-rank checkpoint loads into the split layout: its log-probs are the one rank's again.
        assert four.run(four.client.load_checkpoint(tmp_path / "one-start")) == 0
        reloaded_4 = four.run(four.client.compute_log_probs(batch, temperature=0.8))["log_probs"]
    # A TP=2 checkpoint resumes in one rank: the same log-probs, and the next update runs from the same state.
    with Served("actor", make_config(tiny_llama, actor=TRAIN, **config)) as resumed:
        assert resumed.run(resumed.client.load_checkpoint(tmp_path / "tp-trained")) == 4
        assert_same_float32(resumed.run(resumed.client.compute_log_probs(batch))["log_probs"], trained_4)

    assert_same_float32(old_4, old_1)
    assert_same_float32(squares_4, squares_1, "sum_pi_squared")
    assert_same_float32(reloaded_4, old_1)
    for m1, m4 in zip(metrics_1, metrics_4, strict=True):
        for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
            assert_same_metric(m4[name], m1[name], name)
    assert metrics_1[1]["actor/ppo_kl"] != 0  # the second update is off-policy: the test compares real work
    assert weights_4.keys() == weights_1.keys()
    for name, value in weights_1.items():
        assert_same_update(weights_4[name], value, lr=TRAIN["lr"], steps=4, name=name)  # 2 updates x 2 mini-batches
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[name], weights_4[name]) for name in exported)

    # The weight sync's gather: no collective at all (torch's full state dict all-gathers every tensor onto every
    # rank, twice for a 2-D one); rank 0 receives each shard it lacks once, from one rank: the weights less its
    # own shards. Rank 0 holds a quarter of each layer weight, and half of the rest (FSDP2 over 2 groups).
    assert collectives == 0
    sizes = {name: t.numel() * t.element_size() for name, t in weights_4.items()}
    split = sum(size for name, size in sizes.items() if name.endswith("proj.weight") or name == "lm_head.weight")
    rest = sum(sizes.values()) - split  # embeddings and norms: FSDP2 shards only, the same on both TP ranks
    assert sum(size for _, size in received) == split * 3 // 4 + rest // 2
    assert {src for src, _ in received} == {1, 2, 3}
    assert sum(size for src, size in received if src == 1) == split // 4  # rank 1 = (dp 0, tp 1): no replica sent


def test_tensor_parallel_critic_and_reference_match_one_rank(tiny_model, tmp_path):
    """The tiny Qwen2 (tied head, kept whole) split 2 ways: the critic's values and one update, and the
    reference's log-probs, equal one rank's (in float64: tests/numerics.py)."""
    batch = make_batch(rows=8, prompt_len=7, response_len=5, seed=3)
    tp = {"world_size": 2, "tensor_parallel_size": 2}
    results = {}
    critic_train = {"lr": 1e-3, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}
    for name, critic in (("one", critic_train), ("tp", {**critic_train, **tp})):
        with Served("critic", make_config(tiny_model, n=2, critic=critic, model=FLOAT64)) as served:
            values = served.run(served.client.compute_values(batch))["values"]
            metrics = served.run(served.client.update_values({**batch, "values": values, "returns": values + 1}))
            served.run(served.client.save_checkpoint(tmp_path / f"critic-{name}"))
            results[name] = values, metrics
    assert_same_float32(results["tp"][0], results["one"][0], "values")
    for metric in ("critic/vf_loss", "critic/grad_norm"):
        assert_same_metric(results["tp"][1][metric], results["one"][1][metric], metric)
    weights_one = load_file(tmp_path / "critic-one" / "model.safetensors")
    weights_tp = load_file(tmp_path / "critic-tp" / "model.safetensors")
    assert weights_one.keys() == weights_tp.keys()
    for name, value in weights_one.items():
        assert_same_update(weights_tp[name], value, lr=critic_train["lr"], steps=1, name=name)  # 8 rows: 1 mini-batch
    with Served("reference", make_config(tiny_model, n=2, reference=tp, model=FLOAT64)) as reference:
        split = reference.run(reference.client.compute_log_probs(batch))["log_probs"]
    with Served("reference", make_config(tiny_model, n=2, model=FLOAT64)) as reference:
        whole = reference.run(reference.client.compute_log_probs(batch))["log_probs"]
    assert_same_float32(split, whole, "reference log-probs")


# -- bad input: refused naming the key, before any rank starts --------------------------------------------


@pytest.mark.parametrize(("sections", "message"), [
    ({"actor": {"world_size": 3, "tensor_parallel_size": 2}},
     "actor.tensor_parallel_size 2 does not divide actor.world_size 3"),
    ({"critic": {"world_size": 2, "tensor_parallel_size": 4}},
     "critic.tensor_parallel_size 4 does not divide critic.world_size 2"),
    ({"actor": {"world_size": 2, "tensor_parallel_size": 2, "lora": {"rank": 8}}},
     "actor.tensor_parallel_size 2 with actor.lora.rank 8"),
])
def test_settings_that_cannot_split_are_refused(tiny_model, sections, message):
    with pytest.raises(ValueError, match=message):
        make_config(tiny_model, **sections)


@pytest.mark.parametrize(("role", "tp", "message"), [
    ("actor", 4, "actor.tensor_parallel_size 4: the model's 2 KV heads do not divide by 4 .*never replicates"),
    ("reference", 3, "reference.tensor_parallel_size 3: the model's 4 attention heads do not divide by 3"),
    ("critic", 2, None),
])
def test_models_that_cannot_split_are_refused_before_anything_starts(tiny_llama, role, tp, message):
    sections = {"actor": {"use_kl_loss": True}, "algorithm": {"adv_estimator": "gae"}}  # every trainer role runs
    sections[role] = {**sections.get(role, {}), "world_size": 12, "tensor_parallel_size": tp}
    config = make_config(tiny_llama, **sections)
    if message is None:
        check_model(config)  # the launcher's model check: 2 ways fit
        return
    with pytest.raises(ConfigError, match=message):
        check_model(config)
    with pytest.raises(ConfigError, match=message):  # and the service itself, before it starts its ranks
        asyncio.run(TrainerEngine(role, config).start())


def test_intermediate_size_and_families_without_a_plan(tiny_moe_model):
    llama = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 100}
    assert split_problem(llama, 4) == ""
    assert split_problem(llama, 8) == "the model's 4 attention heads do not divide by 8"
    assert split_problem({**llama, "intermediate_size": 102}, 4) == "the model's intermediate_size 102 does not divide by 4"
    # Qwen3-MoE splits its attention only (the MoE blocks stay whole): its expert widths need not divide.
    moe = {**llama, "model_type": "qwen3_moe", "intermediate_size": 102}
    assert split_problem(moe, 4) == ""
    check_model_split(make_config(tiny_moe_model, actor={"world_size": 2, "tensor_parallel_size": 2}), "actor")
    # Mixtral too (tests/actor/test_router_replay.py trains it under TP 2), but not with router jitter.
    assert split_problem({**moe, "model_type": "mixtral", "router_jitter_noise": 0.0}, 4) == ""
    assert split_problem({**moe, "model_type": "mixtral", "router_jitter_noise": 0.01}, 2) == (
        "the model's router_jitter_noise 0.01 would draw other noise on each tensor-parallel rank (set it to 0 in "
        "config.json)")
    assert split_problem({**llama, "model_type": "gemma"}, 2) == (
        "model_type 'gemma' has no tensor-parallel plan here (plans: llama, qwen2, qwen3_moe, mixtral); train it "
        "data-parallel only")
