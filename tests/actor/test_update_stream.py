"""UpdatePolicyStream: the update batch streamed without its padding (rlfabric.trainer.ragged).

The actor pads the rows back into exactly the tensors the client unpadded (test_round_trip_is_exact), so a
real model's update through the stream is the same computation on the same inputs as through UpdatePolicy:
the bound is bitwise equality, of the metrics and of the weights after (test_stream_update_equals_unary).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from rlfabric.core import codec
from rlfabric.core.config.server import ServerConfig
from rlfabric.core.errors import InvalidArgument
from rlfabric.core.message_limits import MessageLimits
from rlfabric.trainer import ragged
from rlfabric.v1 import actor_pb2, actor_pb2_grpc, tensor_pb2
from tests.trainer.helpers import PAD, Served, make_batch, make_config

ROWS, PROMPT, RESPONSE = 8, 7, 5


def update_batch(rows: int = ROWS, prompt_len: int = PROMPT, response_len: int = RESPONSE) -> dict[str, torch.Tensor]:
    batch = make_batch(rows, prompt_len, response_len)
    g = torch.Generator().manual_seed(1)
    mask = batch["response_mask"]
    return {**batch, "old_log_probs": (-torch.rand(rows, response_len, generator=g) * 5) * mask,
            "advantages": torch.randn(rows, response_len, generator=g) * mask}


def requests(rows: ragged.Unpadded, global_step: int = 0, chunk_bytes: int = ragged.CHUNK_BYTES):
    yield actor_pb2.ActorServiceUpdatePolicyStreamRequest(header=rows.header(global_step))
    for piece in rows.pieces(chunk_bytes):
        yield actor_pb2.ActorServiceUpdatePolicyStreamRequest(rows=piece)


async def aiter(items):
    for item in items:
        yield item


def received(messages) -> ragged.RaggedBatch:
    import asyncio

    return asyncio.run(ragged.received_batch(aiter(list(messages))))


def test_round_trip_is_exact():
    """Many small pieces, MoE routes with their 255 padding: the rebuilt batch is the one sent, dtype and bits."""
    batch = update_batch(rows=50, prompt_len=9, response_len=11)
    attention = batch["attention_mask"].bool()
    routes = torch.randint(0, 8, (50, 20, 2, 3), dtype=torch.uint8)
    batch["routed_experts"] = routes.masked_fill(~attention[..., None, None], 255)
    rows = ragged.unpadded(batch)
    assert rows is not None and rows.pad_token_id == PAD
    messages = list(requests(rows, chunk_bytes=2000))
    assert len(messages) > 4  # header + several pieces
    rebuilt = received(messages).padded()
    assert sorted(rebuilt) == sorted(batch)
    for name, value in batch.items():
        assert rebuilt[name].dtype == value.dtype and torch.equal(rebuilt[name], value), name
    tokens = sum(len(m.rows.sequence["input_ids"].raw_data) for m in messages[1:]) // 8
    assert tokens == int(batch["attention_mask"].sum())  # no padding on the wire


@pytest.mark.parametrize("fault", ["hole in the mask", "padding token varies", "advantage on padding", "bfloat16"])
def test_batches_outside_the_layout_have_no_unpadded_form(fault):
    batch = update_batch()
    if fault == "hole in the mask":
        batch["attention_mask"] = batch["attention_mask"].clone()
        batch["attention_mask"][0, PROMPT + 1] = 0  # row 0 answers 5 tokens: a hole in its response
    elif fault == "padding token varies":
        batch["input_ids"] = batch["input_ids"].clone()
        batch["input_ids"][3, 0] = PAD + 1  # row 3 is left-padded
    elif fault == "advantage on padding":
        batch["advantages"] = batch["advantages"].clone()
        batch["advantages"][ROWS - 1, RESPONSE - 1] = 1.0  # row 7 answers 3 tokens
    else:  # numpy, which cuts the pieces, has no bfloat16
        batch["advantages"] = batch["advantages"].to(torch.bfloat16)
    assert ragged.unpadded(batch) is None


def test_bad_streams_are_named():
    rows = ragged.unpadded(update_batch())
    header, piece = list(requests(rows))[:2]
    with pytest.raises(InvalidArgument, match="before the header"):
        received([piece, header])
    with pytest.raises(InvalidArgument, match="rows sent, the header says"):
        received([header])
    short = tensor_pb2.RaggedRows()
    short.CopyFrom(piece.rows)
    codec.encode_into(short.response["advantages"], torch.zeros(3))
    with pytest.raises(InvalidArgument, match="response tensor advantages has shape"):
        received([header, actor_pb2.ActorServiceUpdatePolicyStreamRequest(rows=short)])


@pytest.fixture(scope="module")
def actors(tiny_model):
    """Two actors from the same checkpoint and config: one updated through each RPC."""
    config = make_config(tiny_model, n=2, actor={"ppo_mini_batch_size": 2})  # 8 rows: 2 optimizer steps
    with Served("actor", config) as unary, Served("actor", config) as streamed:
        yield unary, streamed


def test_stream_update_equals_unary(actors):
    """An old client's UpdatePolicy and the ActorClient's stream train to the same bits."""
    unary, streamed = actors
    batch = update_batch()

    async def old_client():
        async with grpc.aio.insecure_channel(unary.address) as channel:
            request = actor_pb2.ActorServiceUpdatePolicyRequest(global_step=1, batch=codec.encode_batch(batch))
            return await actor_pb2_grpc.ActorServiceStub(channel).UpdatePolicy(request)

    unary_metrics = dict(unary.run(old_client()).metrics)
    stream_metrics = streamed.run(streamed.client.update_policy(batch, global_step=1))
    calls = streamed.service.registry.get_sample_value(
        "grpc_server_handled_total", {"grpc_type": "client_stream", "grpc_service": "rlfabric.v1.ActorService",
                                      "grpc_method": "UpdatePolicyStream", "grpc_code": "OK"})
    assert calls == 1
    timing = {k for k in unary_metrics if k.endswith("_s") or "memory" in k or "/perf/" in k}
    assert {k: v for k, v in unary_metrics.items() if k not in timing} == \
        {k: v for k, v in stream_metrics.items() if k not in timing}
    probe = make_batch(ROWS, PROMPT, RESPONSE, seed=5)
    after_unary = unary.run(unary.client.compute_log_probs(probe))["log_probs"]
    after_stream = streamed.run(streamed.client.compute_log_probs(probe))["log_probs"]
    assert torch.equal(after_unary, after_stream)


def test_bad_stream_is_invalid_argument_and_the_actor_stays_up(actors):
    _, streamed = actors
    batch = update_batch()
    batch["advantages"][2, 1] = float("nan")  # a value the engine checks, not the stream
    rows = ragged.unpadded(batch)
    assert rows is not None

    async def send():
        async with grpc.aio.insecure_channel(streamed.address) as channel:
            return await actor_pb2_grpc.ActorServiceStub(channel).UpdatePolicyStream(aiter(list(requests(rows))))

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        streamed.run(send())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "advantages has 1 NaN/inf value" in caught.value.details()
    assert streamed.run(streamed.client.get_status()).model


def test_a_whole_piece_fits_the_default_message_limit():
    """A piece holds ~CHUNK_BYTES of tensors; the default limits take it (the control limit, 4 MiB, would not)."""
    server = ServerConfig()
    limits = MessageLimits(server.max_receive_message_mb << 20, server.max_control_message_kb << 10)
    assert limits.of("/rlfabric.v1.ActorService/UpdatePolicyStream") >= 2 * ragged.CHUNK_BYTES


class _FailingActor(actor_pb2_grpc.ActorServiceServicer):
    """An actor whose every call ends UNAVAILABLE after reading its request, counting the attempts."""

    def __init__(self):
        self.attempts = {"UpdatePolicyStream": 0, "GetStatus": 0}

    async def UpdatePolicyStream(self, request_iterator, context):
        self.attempts["UpdatePolicyStream"] += 1
        async for _ in request_iterator:
            pass
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the actor went away mid-update")

    async def GetStatus(self, request, context):
        self.attempts["GetStatus"] += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")


def test_a_streamed_update_is_never_retried_as_a_status_call_is():
    """An attempt may have stepped the optimizer before its answer was lost: a repeat would step it twice."""
    import asyncio

    from rlfabric.actor.client import ActorClient
    from rlfabric.core.errors import Unavailable

    async def scenario() -> dict[str, int]:
        actor = _FailingActor()
        server = grpc.aio.server()
        actor_pb2_grpc.add_ActorServiceServicer_to_server(actor, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with ActorClient(f"127.0.0.1:{port}") as client:
                assert ragged.unpadded(update_batch(rows=2)) is not None  # the batch goes as a stream
                with pytest.raises(Unavailable):
                    await client.update_policy(update_batch(rows=2), timeout_s=30)
                with pytest.raises(Unavailable):
                    await client.call("GetStatus", actor_pb2.ActorServiceGetStatusRequest(), timeout_s=30)
        finally:
            await server.stop(None)
        return actor.attempts

    attempts = asyncio.run(scenario())
    assert attempts["UpdatePolicyStream"] == 1
    assert attempts["GetStatus"] > 1  # the channel retries what may be repeated: the check above could fail
