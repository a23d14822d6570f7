"""The rollout service with the hf engine, on a real loopback gRPC server (one per module)."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.core.server import ServerOptions
from rlfabric.rollout.servicer import build_service
from rlfabric.rollout.types import Finish
from rlfabric.v1 import rollout_pb2
from tests.conftest import ServerThread

from .helpers import (
    BAD_REQUESTS,
    generate,
    invalid_argument,
    original_weights,
    reference_logprobs,
    rollout_config,
    stream,
    stub,
    tampered_weights,
)

pytestmark = pytest.mark.slow

PROMPTS = [[1, 90, 88, 74], [1, 70, 88, 88, 78, 88, 89, 70, 83], [40, 41]]


@pytest.fixture(scope="module")
def served(tiny_model):
    # float32 on a GPU too: log-probs are checked against a float32 forward, and samples across batches that
    # bfloat16 kernels of other batch sizes would round differently.
    service = build_service(rollout_config(tiny_model, "rollout.max_num_seqs=16", "rollout.dtype=float32"))
    server = ServerThread(service, ServerOptions(port=0, metrics_port=0))
    with grpc.insecure_channel(server.address) as channel:
        yield server, channel, service.engine
    server.stop()


@pytest.fixture(params=[1, 8], ids=["read_every_step", "read_every_8_steps"])
def steps_per_sync(request, served):
    """The engine reads the sampled tokens every step (its default on the CPU) or every 8 (on a GPU)."""
    engine = served[2]
    default, engine.steps_per_sync = engine.steps_per_sync, request.param
    yield request.param
    engine.steps_per_sync = default


def test_logprobs_match_a_direct_transformers_forward(served, tiny_model):
    from transformers import AutoModelForCausalLM

    _, channel, _ = served
    samples = generate(channel, PROMPTS, n=2, max_tokens=24, temperature=0.7, seed=3)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, s) for p in range(3) for s in range(2)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    diffs = []
    for sample in samples:
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        expected = reference_logprobs(model, PROMPTS[sample.prompt_index], sample.token_ids, 0.7)
        diffs.append((torch.tensor(sample.logprobs) - expected).abs())
    assert torch.cat(diffs).mean() <= 1e-3, torch.cat(diffs).max()


def test_same_seed_same_samples_whatever_the_batch(served, steps_per_sync):
    _, channel, _ = served
    first = generate(channel, PROMPTS, n=3, max_tokens=12, seed=7)
    again = generate(channel, PROMPTS, n=3, max_tokens=12, seed=7)
    other = generate(channel, PROMPTS, n=3, max_tokens=12, seed=8)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert [s.token_ids for s in first] != [s.token_ids for s in other]
    # Samples of one prompt differ from each other, and do not depend on what they are batched with.
    assert len({tuple(s.token_ids) for s in first if s.prompt_index == 0}) == 3
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        alone_later = pool.submit(generate, channel, PROMPTS, n=3, max_tokens=12, seed=7)
        pool.submit(generate, channel, [[9, 9, 9, 9, 9, 9]], n=4, max_tokens=12, seed=1).result()
    assert [s.token_ids for s in alone_later.result()] == [s.token_ids for s in first]


def test_chat_messages_render_the_chat_template(served):
    _, channel, engine = served
    messages = [{"role": "user", "content": "hi"}]
    ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert generate(channel, [messages], seed=1) == generate(channel, [ids], seed=1)


def test_stop_token_ids_strings_and_length(served):
    _, channel, engine = served
    greedy = generate(channel, [PROMPTS[0]], temperature=0.0, max_tokens=12)[0]
    assert greedy.finish_reason in (Finish.LENGTH, Finish.STOP) and greedy.text
    stop_id = greedy.token_ids[3]
    stopped = generate(channel, [PROMPTS[0]], temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,))[0]
    cut = greedy.token_ids.index(stop_id) + 1
    assert stopped.finish_reason == Finish.STOP and stopped.token_ids == greedy.token_ids[:cut]
    char = engine.decode([stop_id])
    by_string = generate(channel, [PROMPTS[0]], temperature=0.0, max_tokens=12, stop=(char,))[0]
    assert by_string.finish_reason == Finish.STOP and char not in by_string.text
    assert by_string.text == greedy.text[: greedy.text.index(char)]
    short = generate(channel, [PROMPTS[1]], temperature=0.0, max_tokens=2)[0]
    assert short.finish_reason in (Finish.LENGTH, Finish.STOP) and len(short.token_ids) <= 2


def test_stream_returns_every_sample_exactly_once(served):
    _, channel, _ = served
    samples = stream(channel, PROMPTS, n=4, max_tokens=16, seed=5)
    keys = [(s.prompt_index, s.sample_index) for s in samples]
    assert sorted(keys) == [(p, s) for p in range(3) for s in range(4)]
    assert sorted(s.token_ids for s in samples) == sorted(s.token_ids for s in generate(
        channel, PROMPTS, n=4, max_tokens=16, seed=5))


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_the_next_request_works(served, case):
    _, channel, _ = served
    prompts, params, phrase = BAD_REQUESTS[case]
    assert phrase in invalid_argument(channel, prompts, **params)
    assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1


def test_load_weights_switches_generation_and_bumps_the_version(served, tiny_model):
    server, channel, engine = served
    before = stub(channel).GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10).weight_version
    try:
        version = server.run(engine.load_weights(tampered_weights(tiny_model, winner=50).items()))
        assert version == before + 1
        samples = generate(channel, PROMPTS, n=2, max_tokens=10, seed=0)
        assert all(s.token_ids == [50] * 10 and s.weight_version == version for s in samples)
        with pytest.raises(Exception, match="unknown weight 'nope'"):
            server.run(engine.load_weights([("nope", torch.zeros(1))]))
        assert server.run(engine.load_weights(original_weights(tiny_model).items(), version=10)) == 10
    finally:
        server.run(engine.load_weights(original_weights(tiny_model).items(), version=10))
    assert any(t != 50 for s in generate(channel, PROMPTS, max_tokens=10, seed=0) for t in s.token_ids)
    status = stub(channel).GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10)
    assert status.weight_version == 10


@pytest.fixture
def slow_decode(served):
    """Each forward of the hf engine takes 5 ms longer, so a request stays in flight for a while."""
    engine = served[2]
    forward = engine.net.forward

    def slow(*args, **kwargs):
        time.sleep(0.005)
        return forward(*args, **kwargs)

    engine.net.forward = slow
    yield
    del engine.net.forward


def wait_for_queue_depth(channel, depth: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while stub(channel).GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5).queue_depth < depth:
        assert time.monotonic() < deadline, f"queue depth never reached {depth}"
        time.sleep(0.02)


def test_pause_holds_new_requests_until_resume_and_abort_ends_in_flight(served, slow_decode, steps_per_sync):
    _, channel, _ = served
    rollout = stub(channel)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # 48 samples, at most 16 decoded at a time (>= 0.45 s): Pause returns only once all have finished.
            accepted = pool.submit(stream, channel, [[5, 6]], n=48, max_tokens=30)
            wait_for_queue_depth(channel, 1)
            assert rollout.Pause(rollout_pb2.RolloutServicePauseRequest(), timeout=30).num_aborted == 0
            finished = accepted.result(timeout=0.2)
            assert len(finished) == 48 and all(s.finish_reason != Finish.ABORT for s in finished)
        assert rollout.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5).paused
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(generate, channel, [[5, 6]], max_tokens=4)
            wait_for_queue_depth(channel, 1)
            time.sleep(0.2)
            assert not held.done()
            rollout.Resume(rollout_pb2.RolloutServiceResumeRequest(), timeout=10)
            assert len(held.result(timeout=30)) == 1
            long = pool.submit(stream, channel, [[5, 6]], n=2, max_tokens=500, temperature=1.0)
            wait_for_queue_depth(channel, 1)
            assert rollout.Pause(rollout_pb2.RolloutServicePauseRequest(abort=True), timeout=30).num_aborted == 1
            aborted = long.result(timeout=30)
    finally:
        rollout.Resume(rollout_pb2.RolloutServiceResumeRequest(), timeout=10)
    assert sorted(s.sample_index for s in aborted) == [0, 1]  # each once; one may have hit EOS first
    assert any(s.finish_reason == Finish.ABORT for s in aborted)
    assert all(len(s.token_ids) < 500 for s in aborted if s.finish_reason == Finish.ABORT)
    assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1


def test_sleep_and_wake_up(served):
    _, channel, _ = served
    rollout = stub(channel)
    rollout.Sleep(rollout_pb2.RolloutServiceSleepRequest(level=1), timeout=30)
    try:
        assert rollout.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5).sleeping
    finally:
        rollout.WakeUp(rollout_pb2.RolloutServiceWakeUpRequest(), timeout=30)
    assert not rollout.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5).sleeping
    with pytest.raises(grpc.RpcError) as info:
        rollout.Sleep(rollout_pb2.RolloutServiceSleepRequest(level=3), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1 or 2" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        rollout.WakeUp(rollout_pb2.RolloutServiceWakeUpRequest(tags=["gpu"]), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1


def test_level_2_frees_the_weights_and_a_sync_in_vllms_order_restores_them(served, tiny_model):
    """The hybrid engine's order (VeRL's): sleep at level 2 (the weights' memory is freed), wake the
    weights (allocated, not yet filled), load the actor's weights, wake the KV cache, generate."""
    server, channel, engine = served
    rollout = stub(channel)

    def status():
        return rollout.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5)

    weights = original_weights(tiny_model)
    server.run(engine.load_weights(list(weights.items())))
    before = generate(channel, PROMPTS, max_tokens=6, seed=5)
    awake = status()
    assert awake.device_memory_bytes > 0 and awake.rss_bytes > awake.device_memory_bytes
    rollout.Sleep(rollout_pb2.RolloutServiceSleepRequest(level=2), timeout=30)
    try:
        asleep = status()
        # The parameters' memory is freed; the rotary tables (buffers, a few hundred bytes) stay.
        assert asleep.sleeping and asleep.device_memory_bytes < awake.device_memory_bytes / 100
        rollout.WakeUp(rollout_pb2.RolloutServiceWakeUpRequest(tags=["weights"]), timeout=30)
        assert not status().sleeping and status().device_memory_bytes == awake.device_memory_bytes
        version = server.run(engine.load_weights(list(weights.items())))
        rollout.WakeUp(rollout_pb2.RolloutServiceWakeUpRequest(tags=["kv_cache"]), timeout=30)
    finally:
        rollout.WakeUp(rollout_pb2.RolloutServiceWakeUpRequest(), timeout=30)
    after = generate(channel, PROMPTS, max_tokens=6, seed=5)
    assert [s.token_ids for s in after] == [s.token_ids for s in before]
    assert all(s.weight_version == version for s in after)


def test_engine_failure_is_unavailable_and_the_service_recovers(served):
    _, channel, engine = served

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    engine.net.forward = broken
    try:
        with pytest.raises(grpc.RpcError) as info:
            generate(channel, [[5, 6]], max_tokens=2)
    finally:
        del engine.net.forward
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "simulated kernel failure" in info.value.details()
    assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1


def test_an_unexpected_error_is_internal_with_its_cause_not_unavailable(served):
    """Only the engine's own failure (above) is UNAVAILABLE; a bug elsewhere on the request's path is
    INTERNAL, named, and the service keeps serving."""
    _, channel, engine = served

    def broken(*args, **kwargs):
        raise KeyError("simulated bug")

    engine.render_chat = broken
    try:
        with pytest.raises(grpc.RpcError) as info:
            generate(channel, [[{"role": "user", "content": "hi"}]], max_tokens=2)
    finally:
        del engine.render_chat
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "KeyError" in info.value.details() and "simulated bug" in info.value.details()
    assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1


def test_a_chat_template_that_rejects_the_messages_is_invalid_argument(served):
    _, channel, engine = served
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}"
                                      "{{ raise_exception('the first message must be from the user') }}{% endif %}"
                                      "{{ messages[0]['content'] }}")
    try:
        details = invalid_argument(channel, [[5, 6], [{"role": "assistant", "content": "hi"}]])
    finally:
        engine.tokenizer.chat_template = template
    assert "prompt 1" in details and "the first message must be from the user" in details


def test_a_weight_swap_mid_generation_continues_the_samples_under_the_new_weights(served, tiny_model, slow_decode,
                                                                                  steps_per_sync):
    """Partial rollouts: the samples in flight stop at the swap, take the new weights (here: token 50 wins
    everywhere) and go on from their prefix; version_spans mark the boundary, across the wire."""
    server, channel, engine = served
    prompts, params = [PROMPTS[0]], {"n": 2, "max_tokens": 120, "temperature": 1.0, "seed": 8}  # 120 and 70 tokens
    uninterrupted = generate(channel, prompts, **params)
    before, tampered = engine.weight_version, tampered_weights(tiny_model, winner=50)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            deadline = time.monotonic() + 20
            while engine._running:  # the uninterrupted run's batch ends just after its samples are delivered
                assert time.monotonic() < deadline, "the batch before never ended"
                time.sleep(0.005)
            streaming = pool.submit(stream, channel, prompts, **params)
            while not any(len(row.token_ids) >= 3 for row in list(engine._running)):
                assert time.monotonic() < deadline and not streaming.done(), "the samples never got going"
                time.sleep(0.005)
            server.run(engine.load_weights(tampered.items(), version=before + 7))
            samples = sorted(streaming.result(timeout=30), key=lambda s: s.sample_index)
    finally:
        server.run(engine.load_weights(original_weights(tiny_model).items(), version=before + 8))
    straddling = [s for s in samples if s.version_spans]
    assert straddling, "no sample was in flight at the swap"
    for sample in straddling:
        (old, start), (new, boundary) = sample.version_spans
        assert (old, start, new) == (before, 0, before + 7) and sample.weight_version == before
        assert 3 <= boundary < len(sample.token_ids) == len(sample.logprobs)
        # Before the boundary: the old weights' tokens (the same seed gives the same prefix); from it on: 50s.
        assert sample.token_ids[:boundary] == uninterrupted[sample.sample_index].token_ids[:boundary]
        assert set(sample.token_ids[boundary:]) == {50}
        assert sample.token_versions() == [before] * boundary + [before + 7] * (len(sample.token_ids) - boundary)


def test_health_answers_while_generating_and_metrics_count(served, slow_decode):
    server, channel, _ = served
    health = health_pb2_grpc.HealthStub(channel)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(generate, channel, PROMPTS, n=8, max_tokens=100, temperature=1.0)
        wait_for_queue_depth(channel, 1)
        start = time.perf_counter()
        response = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        assert time.perf_counter() - start < 1.0 and response.status == health_pb2.HealthCheckResponse.SERVING
        status = stub(channel).GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5)
        assert status.engine == "hf" and status.queue_depth >= 1 and 0 <= status.kv_cache_usage <= 1
        busy.result(timeout=60)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=5).read().decode()
    counted = [line for line in text.splitlines() if line.startswith("rlfabric_rollout_generated_tokens_total ")]
    assert counted and float(counted[0].split()[1]) > 0
    for name in ("rlfabric_rollout_queue_depth", "rlfabric_rollout_weight_version",
                 "rlfabric_rollout_kv_cache_usage_ratio"):
        assert f"\n{name} " in text
