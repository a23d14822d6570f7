"""Bad requests come back INVALID_ARGUMENT with a message naming the problem; the service stays up."""

from __future__ import annotations

import grpc
import pytest
import torch

from rlfabric.core import codec
from rlfabric.core.errors import InvalidArgument, RlfabricError
from rlfabric.v1 import actor_pb2, common_pb2
from tests.trainer.helpers import Served, make_batch, make_config

ROWS, PROMPT, RESPONSE = 8, 7, 5


@pytest.fixture(scope="module")
def actor(tiny_model):
    # Mini-batch of 2 prompts x n=2 = 4 rows: 8 rows split, 6 do not.
    with Served("actor", make_config(tiny_model, n=2, actor={"ppo_mini_batch_size": 2})) as served:
        yield served


def good_update_batch() -> dict[str, torch.Tensor]:
    batch = make_batch(ROWS, PROMPT, RESPONSE)
    return {**batch, "old_log_probs": torch.full((ROWS, RESPONSE), -4.6), "advantages": torch.ones(ROWS, RESPONSE)}


def _set(name, fn):
    def mutate(batch):
        batch[name] = fn(batch[name])
        return batch
    return mutate


def _drop(name):
    def mutate(batch):
        del batch[name]
        return batch
    return mutate


def _mismatched_response(batch):
    batch["responses"] = batch["responses"].clone()
    batch["responses"][0, 0] = 5 if batch["responses"][0, 0] != 5 else 6
    return batch


def _with_nan(name, value):
    def mutate(batch):
        batch[name] = batch[name].clone()
        batch[name][2, 1] = value
        return batch
    return mutate


def _rows(count):
    return lambda batch: {k: v[:count] for k, v in batch.items()}


CASES = {
    "missing advantages": (_drop("advantages"), "missing tensor"),
    "1-D input_ids": (_set("input_ids", lambda t: t.reshape(-1)), "row count|2-D"),
    "attention_mask shape": (_set("attention_mask", lambda t: t[:, 1:]), "attention_mask has shape"),
    "response_mask shape": (_set("response_mask", lambda t: t[:, 1:]), "response_mask has shape"),
    "responses too long": (_set("responses", lambda t: torch.zeros(ROWS, PROMPT + RESPONSE, dtype=torch.int64)),
                           "at least one prompt token"),
    "responses differ from input_ids": (_mismatched_response, "responses must equal the last 5 columns"),
    "token id past the vocabulary": (_set("input_ids", lambda t: t.clone().index_fill_(1, torch.tensor([0]), 10_000)),
                                     "outside the model's vocabulary"),
    "negative token id": (_set("input_ids", lambda t: t.clone().index_fill_(1, torch.tensor([0]), -1)),
                          "outside the model's vocabulary"),
    "mask value 2": (_set("attention_mask", lambda t: t * 2), "only 0 and 1"),
    "float token ids": (_set("input_ids", lambda t: t.float()), "input_ids must be one of int64, int32"),
    "integer advantages": (_set("advantages", lambda t: t.long()), "advantages must be a float tensor"),
    "NaN advantage": (_with_nan("advantages", float("nan")), "advantages has 1 NaN/inf value.*row 2, column 1"),
    "inf old_log_prob": (_with_nan("old_log_probs", float("-inf")), "old_log_probs has 1 NaN/inf"),
    "unknown tensor": (lambda b: {**b, "advantage": b["advantages"]}, "unexpected tensor"),
    "empty batch": (_rows(0), "empty"),
    "rows not a multiple of the mini-batch": (_rows(6), "multiple of the mini-batch of 4 rows"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_update_is_invalid_argument_and_the_next_request_works(actor, case):
    mutate, message = CASES[case]
    with pytest.raises(InvalidArgument, match=message) as raised:
        actor.run(actor.client.update_policy(mutate(good_update_batch())))
    assert "INVALID_ARGUMENT" in str(raised.value)
    out = actor.run(actor.client.compute_log_probs(make_batch(ROWS, PROMPT, RESPONSE)))
    assert out["log_probs"].shape == (ROWS, RESPONSE)


def test_good_update_after_bad_ones(actor):
    metrics = actor.run(actor.client.update_policy(good_update_batch()))
    assert metrics["actor/grad_norm"] > 0


def test_non_positive_temperature_is_invalid(actor):
    with pytest.raises(InvalidArgument, match="temperature must be a positive number"):
        actor.run(actor.client.compute_log_probs(make_batch(), temperature=-1.0))


def _raw_call(actor, method, request):
    async def call():
        try:
            await actor.client.call(method, request)
        except RlfabricError as error:
            return error.code, str(error)
        return grpc.StatusCode.OK, ""
    return actor.run(call())


def test_tensor_with_wrong_byte_length_is_invalid_argument(actor):
    batch = codec.encode_batch(make_batch(ROWS, PROMPT, RESPONSE))
    batch.tensors["attention_mask"].raw_data = batch.tensors["attention_mask"].raw_data[:-3]
    request = actor_pb2.ActorServiceComputeLogProbsRequest(input=common_pb2.LogProbsInput(batch=batch))
    code, details = _raw_call(actor, "ComputeLogProbs", request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "attention_mask: raw_data has" in details


def test_bad_weight_sync_requests_are_invalid_argument(actor):
    code, details = _raw_call(actor, "OpenWeightSyncGroup", actor_pb2.ActorServiceOpenWeightSyncGroupRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_receivers must be 1..16383" in details


def test_kl_loss_needs_ref_log_probs(tiny_model):
    config = make_config(tiny_model, n=2, actor={"ppo_mini_batch_size": 2, "use_kl_loss": True})
    with Served("actor", config) as served:
        with pytest.raises(InvalidArgument, match="missing tensor 'ref_log_probs'"):
            served.run(served.client.update_policy(good_update_batch()))
