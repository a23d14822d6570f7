"""MoE routing replay end to end (actor.router_replay): a bfloat16 hf rollout of a tiny Qwen3-MoE records each
token's experts, they travel with the samples over gRPC and through the coordinator's batch, and the float32
actor replays them, on one rank and under tensor parallelism (TP 2).

Without replay the trainer routes some tokens to other experts than the rollout did (bfloat16 rounds the router
logits: near-ties flip) and its log-probs differ by that too; with replay every recorded route is the one the
trainer's experts run on, and the rollout/trainer log-prob gap drops. The model: 16 experts, 4 per token, 4
layers, initializer_range 0.1 (wider than the tiny model's 0.02, so that the experts' outputs, and a flipped
route's effect, are not lost in the residual stream). Figures measured on this machine (16 samples, 1,932
recorded (token, layer) routes): 33 (1.7%) differ without replay; with replay the mean |rollout - trainer|
log-prob goes from 0.0141 to 0.0061 and the k3 KL from 4.8e-4 to 3.1e-5, one rank, FSDP2 and TP 2 alike. What is left
is bfloat16's rounding of everything else, so the bound is "strictly less", not a ratio."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from rlfabric import algorithms as algos
from rlfabric.coordinator.rollout_batch import build_rollout_batch
from rlfabric.core.config import ConfigError
from rlfabric.core.moe import check_moe_settings
from rlfabric.core.router_replay import replay_routes, routers
from rlfabric.core.server import ServerOptions
from rlfabric.data.dataset import PromptRow
from rlfabric.rollout import wire
from rlfabric.rollout.servicer import build_service
from rlfabric.trainer.batch import ROUTES, position_ids_from_mask, validate_batch
from rlfabric.trainer.objectives import _packing, forward_log_probs, packed_routes
from tests.conftest import ServerThread
from tests.numerics import assert_same_float32, engine_logprob_gap
from tests.rollout.helpers import request, rollout_config, stub
from tests.trainer.helpers import Served, make_config

pytestmark = pytest.mark.slow

EXPERTS, TOP_K, LAYERS, N = 16, 4, 4, 4
ACTOR = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 16, "router_replay": True}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from rlfabric.quickstart.tiny_model import make_tiny_moe_model

    return make_tiny_moe_model(tmp_path_factory.mktemp("replay-moe") / "moe", num_experts=EXPERTS,
                               experts_per_token=TOP_K, num_layers=LAYERS, initializer_range=0.1)


@pytest.fixture(scope="module")
def rollout(moe_model):
    return _sampled(moe_model)


def _sampled(model_path):
    """4 prompts x n=4 sampled by the bfloat16 hf engine over gRPC, and the coordinator's batch of them."""
    config = rollout_config(model_path, "rollout.dtype=bfloat16", "actor.router_replay=true")
    server = ServerThread(build_service(config), ServerOptions(port=0, metrics_port=None))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (length,), generator=generator).tolist() for length in (5, 9, 7, 12)]
    try:
        with grpc.insecure_channel(server.address) as channel:
            reply = stub(channel).Generate(request(prompts, n=N, max_tokens=24, temperature=1.0, seed=3), timeout=60)
    finally:
        server.stop()
    samples = [wire.sample_from_proto(sample) for sample in reply.samples]
    rows = [PromptRow(f"replay:{i}", "test", [], prompt, "", "", "") for i, prompt in enumerate(prompts)]
    return prompts, samples, build_rollout_batch(rows, samples, N, pad_token_id=0)


def _figures(served, batch) -> dict:
    """The actor's log-probs without and with the routes, and its update's route agreement (one optimizer step:
    the agreement is the old policy's)."""
    tensors, routes = dict(batch.tensors), batch.routed_experts
    plain = served.run(served.client.compute_log_probs(tensors))["log_probs"]
    replayed = served.run(served.client.compute_log_probs({**tensors, ROUTES: routes}))["log_probs"]
    metrics = served.run(served.client.update_policy({**tensors, ROUTES: routes, "old_log_probs": replayed,
                                                      "advantages": torch.ones_like(replayed)}))
    mask = batch.response_mask
    return {"plain": plain, "replayed": replayed, "agreement": metrics["actor/router_agreement"],
            "without": algos.mismatch_metrics(plain, batch.rollout_log_probs, mask),
            "with": algos.mismatch_metrics(replayed, batch.rollout_log_probs, mask)}


@pytest.fixture(scope="module")
def one_rank(moe_model, rollout):
    with Served("actor", make_config(moe_model, n=N, actor=ACTOR)) as served:
        return _figures(served, rollout[2])


def _assert_replay_closes_the_gap(figures, recorded: int):
    gap = "rollout_corr/log_prob_abs_diff"
    differing = round((1 - figures["agreement"]) * recorded)
    assert differing > 0, "bfloat16 against float32 left every route alone: the test shows nothing"
    assert figures["with"][gap] < figures["without"][gap]
    assert figures["with"]["rollout_corr/k3_kl"] < figures["without"]["rollout_corr/k3_kl"]


def test_each_sample_carries_the_experts_of_its_prompt_and_response_tokens(rollout):
    prompts, samples, batch = rollout
    for sample in samples:
        routes = sample.routed_experts
        assert routes.dtype == np.uint8 and routes.shape == (len(prompts[sample.prompt_index]) + len(sample.token_ids),
                                                             LAYERS, TOP_K)
        assert (routes[-1] == 255).all()  # the last sampled token never went through the model
        assert (routes[:-1] < EXPERTS).all()
        assert all(len(set(route)) == TOP_K for route in routes[:-1].reshape(-1, TOP_K).tolist())
    assert batch.routed_experts.shape[:2] == batch.tensors["input_ids"].shape


def test_with_replay_the_trainer_routes_every_token_as_the_rollout_did_and_the_gap_drops(moe_model, rollout,
                                                                                         one_rank):
    """The routes the float32 experts run on are the rollout's for 100% of the recorded (token, layer) pairs,
    and the actor service's replayed log-probs are those of a plain transformers forward on them (two float32
    computations of the same network: tests/numerics.py's engine gap)."""
    from transformers import AutoModelForCausalLM

    _, _, batch = rollout
    checked = validate_batch({**batch.tensors, ROUTES: batch.routed_experts}, vocab_size=10**6)
    given = checked[ROUTES].flatten(0, 1)  # [B*S, layers, top_k], -1 where none
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    used = []
    with replay_routes(model, given) as agreement, torch.no_grad():
        hooks = [router.register_forward_hook(lambda _m, _a, out: used.append(out[2])) for router in routers(model)]
        mask = checked["attention_mask"]
        logits = model(input_ids=checked["input_ids"], attention_mask=mask,
                       position_ids=position_ids_from_mask(mask)).logits
        for hook in hooks:
            hook.remove()
    recorded = (given >= 0).all(-1)  # [B*S, layers]
    assert torch.equal(torch.stack(used, 1)[recorded], given[recorded])  # every recorded route, replayed
    matched, counted = agreement.totals()
    assert counted == int(recorded.sum()) and matched / counted == pytest.approx(one_rank["agreement"])
    response_len = batch.response_mask.shape[1]
    direct = algos.log_probs_and_entropy(logits, checked["responses"], 1.0, False,
                                         start=logits.shape[1] - response_len - 1)[0]
    real = batch.response_mask.bool()
    bound = engine_logprob_gap(2 ** np.ceil(np.log2(float(-direct[real].min()))))
    assert (one_rank["replayed"][real] - direct[real]).abs().max() <= bound
    _assert_replay_closes_the_gap(one_rank, counted)


@pytest.mark.numerics
@pytest.mark.parametrize("ranks", [{"world_size": 2}, {"world_size": 2, "tensor_parallel_size": 2},
                                   {"use_remove_padding": True}], ids=["fsdp2", "tp2", "packed"])
def test_sharded_ranks_replay_the_routes_as_one_rank_does(moe_model, rollout, one_rank, ranks):
    """FSDP2 over two ranks (each its half of the rows and their routes), TP 2 (the attention split, the MoE
    blocks whole on each rank, both ranks on the same rows), and sequence packing (one rank, the routes packed
    with their tokens): with the routes replayed each computes the one-rank log-probs up to float32 summation
    order, and replay closes the gap as it does on one rank."""
    _, _, batch = rollout
    with Served("actor", make_config(moe_model, n=N, actor={**ACTOR, **ranks})) as served:
        figures = _figures(served, batch)
    real = batch.response_mask.bool()
    bound = engine_logprob_gap(2 ** np.ceil(np.log2(float(-one_rank["replayed"][real].min()))))
    assert (figures["replayed"][real] - one_rank["replayed"][real]).abs().max() <= bound
    recorded = int((batch.routed_experts != 255).all(-1).sum())
    _assert_replay_closes_the_gap(figures, recorded)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A Mixtral of the Qwen3-MoE's shape (it always renormalises its top-k), its rollout's batch, and the one-rank
    actor's figures on it."""
    from rlfabric.quickstart.tiny_model import make_tiny_mixtral_model

    model = make_tiny_mixtral_model(tmp_path_factory.mktemp("replay-mixtral") / "mixtral", num_experts=EXPERTS,
                                    experts_per_token=TOP_K, num_layers=LAYERS, initializer_range=0.1)
    batch = _sampled(model)[2]
    with Served("actor", make_config(model, n=N, actor=ACTOR)) as served:
        return model, batch, _figures(served, batch)


@pytest.mark.numerics
def test_mixtral_under_tensor_parallelism_replays_the_routes_as_one_rank_does(mixtral):
    """Mixtral's TP plan (the attention split, the MoE blocks whole), TP 2 against one rank, both replaying."""
    model, batch, one_rank = mixtral
    with Served("actor", make_config(model, n=N, actor={**ACTOR, "world_size": 2, "tensor_parallel_size": 2})) as served:
        figures = _figures(served, batch)
    real = batch.response_mask.bool()
    bound = engine_logprob_gap(2 ** np.ceil(np.log2(float(-one_rank["replayed"][real].min()))))
    assert (figures["replayed"][real] - one_rank["replayed"][real]).abs().max() <= bound
    recorded = int((batch.routed_experts != 255).all(-1).sum())
    _assert_replay_closes_the_gap(one_rank, recorded)
    _assert_replay_closes_the_gap(figures, recorded)
    gap = "rollout_corr/log_prob_abs_diff"
    print(f"\nmixtral: {round((1 - figures['agreement']) * recorded)} of {recorded} routes differ without replay; "
          f"{gap} {figures['without'][gap]:.4f} without, {figures['with'][gap]:.4f} with replay (TP 2)")


@pytest.mark.numerics
def test_packed_rows_run_every_token_on_its_recorded_experts_and_give_the_padded_log_probs(moe_model, rollout):
    """Sequence packing with replay: each token's routes go where the token goes in the packed rows, so every
    recorded (token, layer) route of the rollout is the one the packed pass runs on (100%), although the model
    would choose otherwise for some, and the packed log-probs are the padded pass's (float64: the packing
    tests' bound)."""
    from transformers import AutoModelForCausalLM

    _, _, batch = rollout
    checked = validate_batch({**batch.tensors, ROUTES: batch.routed_experts}, vocab_size=10**6)
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad(), replay_routes(model, checked[ROUTES].flatten(0, 1)):
        padded = forward_log_probs(model, checked, 1.0, False, True)[0]
    used = []
    with torch.no_grad(), replay_routes(model, packed_routes(checked)) as agreement:
        hooks = [router.register_forward_hook(lambda _m, _a, out: used.append(out[2])) for router in routers(model)]
        packed = forward_log_probs(model, checked, 1.0, False, True, packed=True)[0]
        for hook in hooks:
            hook.remove()
    where, _, _ = _packing(checked)  # each real token's place in the packed rows
    real = checked["attention_mask"].bool()
    given = checked[ROUTES][real]  # [tokens, layers, top_k], the rollout's
    recorded = (given >= 0).all(-1)
    assert torch.equal(torch.stack(used, 1)[where[real]][recorded], given[recorded])
    matched, counted = agreement.totals()
    assert counted == int(recorded.sum()) == int((batch.routed_experts != 255).all(-1).sum())
    assert matched < counted, "float64 chose every bfloat16 route itself: the test shows nothing"
    response = checked["response_mask"].bool()
    assert_same_float32(packed[response], padded[response], "log-probs")


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=vllm", "actor.router_replay: rollout.engine vllm does not record"),
])
def test_settings_replay_cannot_work_with_are_refused_naming_the_key(moe_model, override, message):
    config = rollout_config(moe_model, "actor.router_replay=true", override)
    with pytest.raises(ConfigError, match=message):
        check_moe_settings(config, on_gpu=True)


def test_replay_for_a_dense_model_is_refused_naming_the_key(tiny_model):
    with pytest.raises(ConfigError, match=r"actor.router_replay: model.path .* is a dense model \(model_type qwen2\)"):
        check_moe_settings(rollout_config(tiny_model, "actor.router_replay=true"), on_gpu=False)
