"""The SGLang adapter against FakeSGLangServer (tests/rollout/fake_sglang.py), a stand-in HTTP server
written for these tests (SGLang cannot run here): it records the exact JSON the adapter sends and answers
the way the SGLang endpoints do. Weight sync through a real actor into the fake is in
tests/weight_sync/test_sync_sglang.py. A real-SGLang test at the end runs only on a GPU machine with a server."""

from __future__ import annotations

import os

import grpc
import pytest
import torch

from rlfabric.core.errors import FailedPrecondition
from rlfabric.core.server import ServerOptions
from rlfabric.rollout.servicer import build_service
from rlfabric.rollout.sglang_engine import check_dense
from rlfabric.rollout.types import Finish, row_seed
from rlfabric.v1 import rollout_pb2
from rlfabric.weight_sync.manifest import BucketSpec, Manifest, SyncGroup, TensorSpec
from tests.conftest import ServerThread

from .fake_sglang import FakeSGLangServer
from .helpers import generate, invalid_argument, rollout_config, stream, stub


@pytest.fixture(scope="module")
def fake():
    server = FakeSGLangServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def served(fake, tiny_model):
    config = rollout_config(tiny_model, "rollout.engine=sglang", f"rollout.sglang_url={fake.url}")
    service = build_service(config)
    server = ServerThread(service, ServerOptions(port=0, metrics_port=0))
    with grpc.insecure_channel(server.address) as channel:
        yield server, channel, service.engine
    server.stop()


def test_start_waits_for_health_and_reads_the_weight_version(served, fake):
    _, channel, _ = served
    assert ("GET", "/health_generate", None) in fake.calls
    status = stub(channel).GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5)
    assert (status.engine, status.weight_version) == ("sglang", 7)


def test_generate_sends_one_exact_request_per_sample_and_maps_the_answer(served, fake):
    _, channel, _ = served
    fake.calls.clear()
    samples = generate(channel, [[5, 6], [9]], n=2, max_tokens=3, temperature=0.5, top_p=0.9, top_k=20,
                       stop=("\n",), stop_token_ids=(4,), seed=11)
    sent = sorted(fake.posts("/generate"), key=lambda p: p["rid"])
    assert len(sent) == 4
    rids = [p.pop("rid") for p in sent]
    assert [r.rsplit("-", 2)[1:] for r in rids] == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]
    expected = []
    for p, prompt in enumerate([[5, 6], [9]]):
        for s in range(2):
            expected.append({
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"n": 1, "temperature": 0.5, "top_p": pytest.approx(0.9), "top_k": 20,
                                    "max_new_tokens": 3, "stop": ["\n"], "stop_token_ids": [4],
                                    "skip_special_tokens": True, "sampling_seed": row_seed(11, p, s)},
            })
    assert sent == expected
    assert [(s.prompt_index, s.sample_index, s.token_ids) for s in samples] == [
        (0, 0, [7, 7, 7]), (0, 1, [7, 7, 7]), (1, 0, [10, 10, 10]), (1, 1, [10, 10, 10])]
    assert all(s.logprobs == [-0.25] * 3 and s.finish_reason == Finish.LENGTH and s.text == "xxx" for s in samples)
    assert all(s.weight_version == 7 for s in samples)


def test_chat_prompts_are_rendered_here_and_sent_as_token_ids(served, fake):
    _, channel, engine = served
    fake.calls.clear()
    stream(channel, [[{"role": "user", "content": "hi"}]], max_tokens=1)
    ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert fake.posts("/generate")[0]["input_ids"] == ids


def test_server_errors_map_to_status_codes(served, fake):
    _, channel, _ = served
    try:
        fake.fail_generate = (400, '{"error": "bad stop"}')
        assert "bad stop" in invalid_argument(channel, [[5]])
        fake.fail_generate = (500, '{"error": "CUDA error: out of memory"}')
        with pytest.raises(grpc.RpcError) as info:
            generate(channel, [[5]])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "out of memory" in info.value.details()
        fake.fail_generate = (200, '{"text": "no output_ids"}')
        with pytest.raises(grpc.RpcError) as info:
            generate(channel, [[5]])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "unexpected answer" in info.value.details()
    finally:
        fake.fail_generate = None
    assert "prompt 0 is empty" in invalid_argument(channel, [[]])  # validated here, never sent
    assert len(generate(channel, [[5]])) == 1


def test_pause_resume_sleep_wake_send_the_sglang_calls(served, fake):
    _, channel, _ = served
    rollout = stub(channel)
    fake.calls.clear()
    rollout.Pause(rollout_pb2.RolloutServicePauseRequest(abort=True), timeout=10)
    rollout.Resume(rollout_pb2.RolloutServiceResumeRequest(), timeout=10)
    rollout.Pause(rollout_pb2.RolloutServicePauseRequest(abort=False), timeout=10)
    rollout.Resume(rollout_pb2.RolloutServiceResumeRequest(), timeout=10)
    rollout.Sleep(rollout_pb2.RolloutServiceSleepRequest(level=1), timeout=10)
    assert rollout.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5).sleeping
    rollout.WakeUp(rollout_pb2.RolloutServiceWakeUpRequest(tags=["weights"]), timeout=10)
    rollout.WakeUp(rollout_pb2.RolloutServiceWakeUpRequest(), timeout=10)
    assert [(p, body) for _, p, body in fake.calls] == [
        ("/pause_generation", {"mode": "abort"}), ("/continue_generation", {}),
        ("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {}),
        ("/release_memory_occupation", {}),
        ("/resume_memory_occupation", {"tags": ["weights"]}), ("/resume_memory_occupation", {}),
    ]
    assert len(generate(channel, [[5]])) == 1


def test_weight_updates_from_disk_send_the_sglang_calls(served, fake):
    server, _, engine = served
    fake.calls.clear()
    assert server.run(engine.update_weights_from_disk("/ckpt/step-9", version=9)) == 9
    assert engine.status().weight_version == 9
    assert [(p, body) for _, p, body in fake.calls] == [
        ("/update_weights_from_disk", {"model_path": "/ckpt/step-9", "weight_version": "9"}),
        ("/flush_cache", {}),
    ]
    with pytest.raises(Exception, match="cannot take in-memory tensors"):
        server.run(engine.load_weights([("lm_head.weight", torch.zeros(1))]))


def test_a_group_sglang_cannot_join_is_refused_before_the_server_is_asked(served, fake):
    server, _, engine = served
    fake.calls.clear()
    with pytest.raises(FailedPrecondition, match="not a torch group"):
        server.run(engine.join_weight_sync(SyncGroup("ws-1", "gloo", 2, 5.0, "127.0.0.1", 1234), 1))
    with pytest.raises(FailedPrecondition, match="has not joined a weight-sync group"):
        server.run(engine.receive_weights(Manifest(1, "ws-1")))
    assert fake.calls == []


def test_a_manifest_packed_with_gaps_is_refused():
    spec = TensorSpec("a", torch.float32, (3,), 0)
    check_dense(Manifest(1, "ws", (BucketSpec(0, 24, (spec, TensorSpec("b", torch.float32, (3,), 12))),)))
    with pytest.raises(FailedPrecondition, match="b starts at byte 64, not 12; SGLang takes dense buckets"):
        check_dense(Manifest(1, "ws", (BucketSpec(0, 76, (spec, TensorSpec("b", torch.float32, (3,), 64))),)))


def test_unreachable_server_is_unavailable(tiny_model):
    from rlfabric.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(rollout_config(tiny_model, "rollout.sglang_url=http://127.0.0.1:9"))
    with pytest.raises(Exception) as info:
        engine._http("POST", "/generate", {}, 2.0)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "unreachable" in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not os.environ.get("RLFABRIC_SGLANG_URL"),
                    reason="needs a GPU and a running SGLang server at $RLFABRIC_SGLANG_URL serving $RLFABRIC_SGLANG_MODEL")
def test_real_sglang_server_generates():
    config = rollout_config(os.environ["RLFABRIC_SGLANG_MODEL"], "rollout.engine=sglang",
                            f"rollout.sglang_url={os.environ['RLFABRIC_SGLANG_URL']}")
    service = build_service(config)
    server = ServerThread(service, ServerOptions(port=0, metrics_port=0))
    try:
        with grpc.insecure_channel(server.address) as channel:
            samples = generate(channel, [[{"role": "user", "content": "Say hi."}]], n=2, max_tokens=8, seed=1)
            assert len(samples) == 2 and all(len(s.token_ids) == len(s.logprobs) > 0 for s in samples)
            assert [s.token_ids for s in samples] == [s.token_ids for s in generate(
                channel, [[{"role": "user", "content": "Say hi."}]], n=2, max_tokens=8, seed=1)]
    finally:
        server.stop()


def test_the_grpc_transport_cannot_reach_sglang():
    from rlfabric.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="weight_sync.transport grpc cannot reach an SGLang server"):
        load_config(None, ["rollout.engine=sglang", "weight_sync.transport=grpc"])
