"""Back-pressure on real services: past a limit, the surplus is refused with RESOURCE_EXHAUSTED (never
INTERNAL/UNKNOWN, never queued without bound), the accepted calls succeed, health still answers
SERVING, and the service serves normally afterwards.

1. server.max_concurrent_rpcs (every service; interceptors.ConcurrencyLimitInterceptor): a reward
   service whose custom function is slow, more concurrent Score calls than the limit.
2. rollout.max_pending_requests (the rollout's admission limit): a paused rollout holds the
   generation requests it admits; the ones past the limit are refused at once.
"""

from __future__ import annotations

import json
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from rlfabric.core.config import ConfigError, config_from_dict
from rlfabric.core.server import ServerOptions
from rlfabric.reward.servicer import build_service as build_reward_service
from rlfabric.rollout.servicer import build_service as build_rollout_service
from rlfabric.v1 import reward_pb2, rollout_pb2
from tests.waiting import wait_until

from .helpers import (
    GENERATE,
    GENERATE_STREAM,
    GET_STATUS,
    PAUSE,
    RESUME,
    SCORE,
    SERVING,
    Answer,
    Method,
    call_raw,
    good_generate_request,
    good_score_request,
    health,
    trainer_config,
)

SLOW_S = 2.0  # how long the slow reward function takes per item
SLOW_REWARD = textwrap.dedent(
    f"""
    import time


    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if extra_info.get("slow"):
            time.sleep({SLOW_S})
        return 1.0
    """
)


def call(address: str, method: Method, payload, timeout: float = 60.0) -> Answer:
    with grpc.insecure_channel(address) as channel:
        return call_raw(channel, method, payload, timeout=timeout)


def score_request(slow: bool) -> bytes:
    item = reward_pb2.ScoreItem(data_source="x", response="r", ground_truth="g",
                                extra_info_json=json.dumps({"slow": slow}))
    return reward_pb2.RewardServiceScoreRequest(items=[item]).SerializeToString()


def concurrently(*calls) -> list[Answer]:
    """Runs the zero-argument callables at once (one thread and one channel each); their answers in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(c) for c in calls]]


def handled(service, code: str) -> float:
    """grpc_server_handled_total of every method with that code, from the service's registry."""
    total = 0.0
    for metric in service.registry.collect():
        for sample in metric.samples:
            if sample.name == "grpc_server_handled_total" and sample.labels.get("grpc_code") == code:
                total += sample.value
    return total


# --- 1. server.max_concurrent_rpcs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited_reward(serve_module, tmp_path_factory):
    """A reward service (slow custom function, 2 workers) that runs at most 2 RPCs at once."""
    path = tmp_path_factory.mktemp("backpressure") / "slow_reward.py"
    path.write_text(SLOW_REWARD)
    config = config_from_dict({"server": {"max_concurrent_rpcs": 2},
                               "reward": {"custom_path": str(path), "num_workers": 2, "timeout_s": 30}})
    service = build_reward_service(config)
    thread = serve_module(service, ServerOptions.from_config(config.server, port=0, metrics_port=None))
    return service, thread


def test_the_surplus_over_max_concurrent_rpcs_gets_resource_exhausted(limited_reward):
    service, thread = limited_reward
    address = thread.address
    probes: list[int] = []

    def probe_while_loaded() -> None:  # health checks while both slots are taken
        wait_until(lambda: thread.server.concurrency_limit.active == 2, 30, "both slots taken")
        probes.extend(health(address, name) for name in ("", "liveness", "readiness"))

    prober = threading.Thread(target=probe_while_loaded)
    prober.start()
    answers = concurrently(*[lambda: call(address, SCORE, score_request(slow=True))] * 6)
    prober.join()

    codes = sorted(answer.code.name for answer in answers)
    assert codes == ["OK"] * 2 + ["RESOURCE_EXHAUSTED"] * 4, [(a.code.name, a.details) for a in answers]
    for answer in answers:
        if answer.code == grpc.StatusCode.OK:
            assert reward_pb2.RewardServiceScoreResponse.FromString(answer.responses[0]).results[0].score == 1.0
        else:  # refused at once, with a message that says which limit and how to raise it
            assert answer.seconds < SLOW_S, answer
            assert "server.max_concurrent_rpcs=2" in answer.details and "reward" in answer.details, answer.details
    assert probes == [SERVING] * 3  # health is exempt: probes answer while the service is saturated
    assert handled(service, "RESOURCE_EXHAUSTED") >= 4  # refusals show in grpc_server_handled_total

    # The slots are free again: the service serves normally.
    assert [call(address, SCORE, score_request(slow=False)).code for _ in range(3)] == [grpc.StatusCode.OK] * 3
    assert health(address) == SERVING


def test_calls_up_to_the_limit_are_all_served(limited_reward):
    _, thread = limited_reward
    answers = concurrently(*[lambda: call(thread.address, SCORE, score_request(slow=False))] * 2)
    assert [answer.code for answer in answers] == [grpc.StatusCode.OK] * 2


def test_zero_means_no_limit_and_negative_is_refused():
    assert ServerOptions.from_config(config_from_dict({"server": {"max_concurrent_rpcs": 0}}).server,
                                     port=0).max_concurrent_rpcs == 0
    assert config_from_dict({}).server.max_concurrent_rpcs > 0  # on by default, generous
    with pytest.raises(ConfigError, match="max_concurrent_rpcs"):
        config_from_dict({"server": {"max_concurrent_rpcs": -1}})


def test_without_a_limit_no_interceptor_counts_rpcs(serve_module):
    config = config_from_dict({"server": {"max_concurrent_rpcs": 0}})
    thread = serve_module(build_reward_service(config),
                          ServerOptions.from_config(config.server, port=0, metrics_port=None))
    assert thread.server.concurrency_limit is None
    answers = concurrently(*[lambda: call(thread.address, SCORE, good_score_request().SerializeToString())] * 4)
    assert [answer.code for answer in answers] == [grpc.StatusCode.OK] * 4


# --- 2. rollout.max_pending_requests ----------------------------------------------------------------


@pytest.fixture(scope="module")
def limited_rollout(serve_module, tiny_model):
    """A rollout (hf engine, tiny model) that holds at most 2 generation requests."""
    config = trainer_config(tiny_model, rollout={"max_pending_requests": 2})
    thread = serve_module(build_rollout_service(config),
                          ServerOptions.from_config(config.server, port=0, metrics_port=None))
    return thread.address


def _queue_depth(address: str) -> int:
    answer = call(address, GET_STATUS, b"")
    assert answer.code == grpc.StatusCode.OK, answer.details
    return rollout_pb2.RolloutServiceGetStatusResponse.FromString(answer.responses[0]).queue_depth


def test_generation_requests_past_the_rollout_limit_get_resource_exhausted(limited_rollout):
    address = limited_rollout
    generate = good_generate_request().SerializeToString()
    stream = good_generate_request(rollout_pb2.RolloutServiceGenerateStreamRequest).SerializeToString()
    pause = rollout_pb2.RolloutServicePauseRequest(abort=False).SerializeToString()
    assert call(address, PAUSE, pause).code == grpc.StatusCode.OK
    resumed = False
    try:
        with ThreadPoolExecutor(2) as pool:
            # Paused, the rollout admits these two and holds them: the limit is reached.
            held = [pool.submit(call, address, GENERATE, generate), pool.submit(call, address, GENERATE_STREAM, stream)]
            wait_until(lambda: _queue_depth(address) == 2, 30, "the paused rollout to hold the two requests")

            refused = concurrently(*[lambda: call(address, GENERATE, generate)] * 3,
                                   lambda: call(address, GENERATE_STREAM, stream))
            for answer in refused:
                assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (answer.code.name, answer.details)
                assert "rollout.max_pending_requests=2" in answer.details, answer.details
                assert not answer.responses
            # Control RPCs and health still answer while the rollout is full.
            assert health(address) == SERVING and _queue_depth(address) == 2

            assert call(address, RESUME, b"").code == grpc.StatusCode.OK
            resumed = True
            for future in held:
                answer = future.result(timeout=60)
                assert answer.code == grpc.StatusCode.OK, answer.details
        generated = rollout_pb2.RolloutServiceGenerateResponse.FromString(held[0].result().responses[0])
        assert len(generated.samples) == 2
        assert len(held[1].result().responses) == 2  # one message per sample
    finally:
        if not resumed:
            call(address, RESUME, b"")

    # Slots freed when the requests finished: the rollout serves normally again.
    answers = concurrently(*[lambda: call(address, GENERATE, generate)] * 2)
    assert [answer.code for answer in answers] == [grpc.StatusCode.OK] * 2
    assert _queue_depth(address) == 0 and health(address) == SERVING
