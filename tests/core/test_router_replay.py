"""MoE routing replay's pieces (rlfabric.core.router_replay, rlfabric.rollout.routes): the compact route encoding round-trips through a
sample on the wire, replaying a model's own routes changes nothing, replayed routes are the ones the experts
run on with the router's own weights at them, the coordinator lays routes out at the batch's real tokens,
and malformed routes are refused naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.coordinator.rollout_batch import build_rollout_batch
from rlfabric.core.errors import InvalidArgument
from rlfabric.core.router_replay import RouteRecorder, replay_routes, routers
from rlfabric.data.dataset import PromptRow
from rlfabric.rollout import wire
from rlfabric.rollout.routes import decode_routes, encode_routes, route_dtype
from rlfabric.rollout.types import Finish, FinishedSample
from rlfabric.trainer.batch import ROUTES, validate_batch

LAYERS, TOP_K, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def moe_models():
    """A tiny random Qwen3-MoE and Mixtral (float32, eager experts), built in memory."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shared = dict(vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=TOP_K, intermediate_size=32)
    torch.manual_seed(0)
    qwen = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=32, norm_topk_prob=True,
                                              experts_implementation="eager", **shared)).eval()
    mixtral = MixtralForCausalLM(MixtralConfig(num_local_experts=EXPERTS, experts_implementation="eager",
                                               **shared)).eval()
    return {"qwen3_moe": qwen, "mixtral": mixtral}


def _own_routes(model, input_ids):
    with RouteRecorder(model) as recorder, torch.no_grad():
        logits = model(input_ids=input_ids).logits
        return recorder.take(), logits


@pytest.mark.parametrize("experts, width", [(EXPERTS, 1), (300, 2)])
def test_the_compact_encoding_round_trips_through_a_sample_on_the_wire(experts, width):
    dtype = route_dtype(experts)
    routes = np.random.default_rng(0).integers(0, experts, (9, LAYERS, TOP_K)).astype(dtype)
    routes[-1] = np.iinfo(dtype).max  # the last response token: not recorded
    sample = FinishedSample(0, 0, [5, 6, 7], [-0.1, -0.2, -0.3], Finish.STOP, 0, routed_experts=routes)
    message = wire.sample_to_proto(sample)
    assert message.routed_experts.id_bytes == width and len(message.routed_experts.ids) == routes.size * width
    back = wire.sample_from_proto(message).routed_experts
    assert back.dtype == dtype and np.array_equal(back, routes)
    assert wire.sample_from_proto(wire.sample_to_proto(FinishedSample(0, 0, [5], [], Finish.STOP, 0))
                                  ).routed_experts is None


@pytest.mark.parametrize("fields, message", [
    ((b"\x00" * 8, 2, 2, 3), "id_bytes must be 1 or 2"),
    ((b"\x00" * 7, 2, 2, 1), "not a multiple of layers x top_k x id_bytes = 4"),
    ((b"", 0, 2, 1), "layers and top_k >= 1"),
])
def test_malformed_routes_off_the_wire_are_refused_naming_the_fault(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        decode_routes(*fields)


def test_encoding_refuses_routes_of_another_shape_or_type():
    with pytest.raises(ValueError, match="tokens, layers, top_k"):
        encode_routes(np.zeros((3, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8 or uint16"):
        encode_routes(np.zeros((3, 2, 2), dtype=np.int64))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replaying_the_models_own_routes_changes_nothing(moe_models, family):
    """The replayed weights are the router's softmax at the same ids, normalised the same way: bit for bit."""
    model = moe_models[family]
    assert len(routers(model)) == LAYERS
    input_ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    own, logits = _own_routes(model, input_ids)
    with replay_routes(model, own) as agreement, torch.no_grad():
        replayed = model(input_ids=input_ids).logits
    assert torch.equal(replayed, logits)
    assert agreement.totals() == (3 * 7 * LAYERS, 3 * 7 * LAYERS)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_experts_run_on_the_replayed_routes_with_the_routers_weights_at_them(moe_models, family):
    model = moe_models[family]
    input_ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    own, _ = _own_routes(model, input_ids)
    given = (own + 1) % EXPERTS  # every route another set of experts
    given[3] = -1  # a token without routes: the router chooses itself
    seen = []

    def look(router, _args, output):  # registered after the replay's hook: sees what the experts get
        seen.append((output[0], output[1], output[2]))

    with replay_routes(model, given) as agreement, torch.no_grad():
        hooks = [router.register_forward_hook(look) for router in routers(model)]
        model(input_ids=input_ids)
        for hook in hooks:
            hook.remove()
    used = torch.stack([ids for _, _, ids in seen], dim=1)  # [tokens, layers, top_k]
    expected = given.clone()
    expected[3] = own[3]
    assert torch.equal(used, expected)
    for layer, (logits, weights, ids) in enumerate(seen):
        probs = torch.softmax(logits.float(), -1).gather(-1, ids)
        assert torch.allclose(weights.float(), probs / probs.sum(-1, keepdim=True), atol=1e-6, rtol=0), layer
    assert agreement.totals() == (0, (2 * 5 - 1) * LAYERS)  # the unrecorded token does not count


def test_routes_that_do_not_fit_the_model_are_refused(moe_models):
    model = moe_models["qwen3_moe"]
    input_ids = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(InvalidArgument, match="the model has 2 MoE layers"):
        with replay_routes(model, torch.zeros(4, 3, TOP_K, dtype=torch.int64)):
            pass
    with pytest.raises(InvalidArgument, match="top_k 3 but the model's routers choose 2"):
        with replay_routes(model, torch.zeros(4, LAYERS, 3, dtype=torch.int64)):
            pass
    with pytest.raises(InvalidArgument, match="expert id 4; the model's routers choose among 4 experts"):
        with replay_routes(model, torch.full((4, LAYERS, TOP_K), EXPERTS, dtype=torch.int64)):
            pass
    with pytest.raises(InvalidArgument, match="5 tokens but the forward pass runs 4"):
        with replay_routes(model, torch.zeros(5, LAYERS, TOP_K, dtype=torch.int64)), torch.no_grad():
            model(input_ids=input_ids)


def test_the_coordinator_lays_each_samples_routes_at_its_real_tokens():
    prompts = [[3, 4, 5], [6, 7]]
    rows = [PromptRow(f"t:{i}", "d", [], p, "", "", "") for i, p in enumerate(prompts)]
    lengths = {0: 2, 1: 4}  # response tokens
    samples, routes = [], {}
    for index, prompt in enumerate(prompts):
        tokens = len(prompt) + lengths[index]
        routes[index] = np.arange(tokens * LAYERS * TOP_K, dtype=np.uint8).reshape(tokens, LAYERS, TOP_K) % 200
        samples.append(FinishedSample(index, 0, [9] * lengths[index], [-1.0] * lengths[index], Finish.STOP, 0,
                                      routed_experts=routes[index]))
    batch = build_rollout_batch(rows, samples, 1, 0)
    laid = batch.routed_experts  # [2, P+T = 3+4, layers, top_k]
    mask = batch.tensors["attention_mask"].bool()
    assert laid.shape == (2, 7, LAYERS, TOP_K) and laid.dtype == torch.uint8
    for row in range(2):
        assert np.array_equal(laid[row][mask[row]].numpy(), routes[row])
        assert (laid[row][~mask[row]] == 255).all()  # padding: none
    checked = validate_batch({**batch.tensors, ROUTES: laid}, vocab_size=16)[ROUTES]
    assert checked.dtype == torch.int64 and (checked[~mask] == -1).all()
    assert torch.equal(checked[mask], laid[mask].long())
    samples[1].routed_experts = routes[1][:-1]
    with pytest.raises(ValueError, match=r"sample \(1, 0\) has routes for 5 tokens but 6"):
        build_rollout_batch(rows, samples, 1, 0)


def test_the_trainer_refuses_routes_of_the_wrong_shape_or_type():
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.int64), "attention_mask": torch.ones(2, 4, dtype=torch.int64),
             "responses": torch.ones(2, 2, dtype=torch.int64), "response_mask": torch.ones(2, 2, dtype=torch.int64)}
    with pytest.raises(InvalidArgument, match=r"routed_experts has shape \[2, 3, 2, 2\]"):
        validate_batch({**batch, ROUTES: torch.zeros(2, 3, 2, 2, dtype=torch.uint8)}, vocab_size=16)
    with pytest.raises(InvalidArgument, match="routed_experts must be one of uint8, int32, int64, got float32"):
        validate_batch({**batch, ROUTES: torch.zeros(2, 4, 2, 2)}, vocab_size=16)
    with pytest.raises(InvalidArgument, match="negative expert id other than -1"):
        validate_batch({**batch, ROUTES: torch.full((2, 4, 2, 2), -2, dtype=torch.int32)}, vocab_size=16)
