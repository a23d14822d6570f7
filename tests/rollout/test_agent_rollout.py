"""Multi-turn requests of the rollout service (hf engine, tiny model) against a real environment
service, both on loopback gRPC: token in and token out through the wire, the loss mask, every
environment failure mode ending its own sample only, bad requests INVALID_ARGUMENT, and the metrics."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from rlfabric.core.config import EnvConfig, RunConfig
from rlfabric.core.server import ServerOptions
from rlfabric.env import Environment, register_environment
from rlfabric.env.items import Message, StepResult
from rlfabric.env.servicer import build_service as build_env_service
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.rollout import wire
from rlfabric.rollout.agent_loop import ENV_FAILED, MAX_TURNS
from rlfabric.rollout.servicer import build_service
from rlfabric.rollout.types import AgentPrompt, AgentTask, MultiTurnSpec, SamplingSpec
from rlfabric.v1 import rollout_pb2
from tests.conftest import ServerThread, closed_port

from .helpers import listed, rollout_config, stub

TOKENIZER = build_tokenizer()
QUESTION = [{"role": "user", "content": "Say something."}]
STOPS = tuple(range(5, 40))  # random turns of the tiny model end after a few tokens, with finish STOP
release_sleepy_steps = threading.Event()


class Again(Environment):
    """Never done: every turn is answered "again" (reward 0.25)."""

    def reset(self):
        return []

    def step(self, action):
        return StepResult([Message("user", "again")], reward=0.25)


class Sleepy(Again):
    def step(self, action):
        release_sleepy_steps.wait(10)
        return super().step(action)


class Garbage(Again):
    def step(self, action):
        return StepResult([Message("assistant", "I am the model now")])


register_environment("agent-rollout-again", lambda task, config: Again())
register_environment("agent-rollout-sleepy", lambda task, config: Sleepy())
register_environment("agent-rollout-garbage", lambda task, config: Garbage())


@pytest.fixture(scope="module")
def dead_env_address() -> str:
    """An address on loopback that refuses connections, which the rollout's config allows."""
    return f"127.0.0.1:{closed_port()}"


@pytest.fixture(scope="module")
def mesh(tiny_model, dead_env_address):
    """(env server, rollout server, rollout channel): the rollout's multi_turn.env_address is the env's."""
    env = ServerThread(build_env_service(RunConfig(env=EnvConfig())), ServerOptions(port=0, metrics_port=0))
    config = rollout_config(tiny_model, f"rollout.multi_turn.env_address={env.address}", "rollout.max_num_seqs=8",
                            f"rollout.multi_turn.allowed_env_addresses=[{dead_env_address}]")
    rollout = ServerThread(build_service(config), ServerOptions(port=0, metrics_port=0))
    with grpc.insecure_channel(rollout.address) as channel:
        yield env, rollout, channel
    release_sleepy_steps.set()
    rollout.stop()
    env.stop()


def agent_request(environments, n=1, max_turns=3, max_total_tokens=200, **multi_turn):
    prompts = [AgentPrompt(QUESTION, AgentTask(name, "7", {"note": "x"})) for name in environments]
    spec = SamplingSpec(n=n, max_tokens=16, temperature=1.0, seed=5, stop_token_ids=STOPS,
                        multi_turn=MultiTurnSpec(max_turns=max_turns, max_total_tokens=max_total_tokens,
                                                 env_timeout_s=multi_turn.pop("env_timeout_s", 10.0), **multi_turn))
    return rollout_pb2.RolloutServiceGenerateRequest(prompts=[wire.prompt_to_proto(p) for p in prompts],
                                                     sampling_params=wire.sampling_to_proto(spec))


def agent_generate(channel, environments, **params):
    response = stub(channel).Generate(agent_request(environments, **params), timeout=60)
    return [listed(s) for s in response.samples]


def rendered_conversation(sample) -> str:
    """The chat template's text of the whole conversation the sample holds: each model turn's ids as the
    assistant's content, each observation as the user's "again", then the next assistant header."""
    conversation, start = list(QUESTION), 0
    for turn in sample.turns:
        turn_ids = sample.token_ids[start:start + turn.model_tokens]
        if turn_ids[-1] == TOKENIZER.eos_token_id:
            turn_ids = turn_ids[:-1]
        conversation.append({"role": "assistant", "content": TOKENIZER.decode(turn_ids)})
        if turn.observation_tokens:
            conversation.append({"role": "user", "content": "again"})
        start += turn.model_tokens + turn.observation_tokens
    return TOKENIZER.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def test_multi_turn_samples_are_the_rendered_conversation_token_for_token(mesh):
    _, rollout, channel = mesh
    samples = agent_generate(channel, ["agent-rollout-again"] * 2, n=2)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({tuple(s.token_ids) for s in samples}) > 1  # each sample (and turn) draws its own
    for sample in samples:
        assert (sample.agent_status, len(sample.turns)) == (MAX_TURNS, 3)
        assert sample.prompt_ids == TOKENIZER.encode(
            TOKENIZER.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False))
        assert TOKENIZER.decode(sample.prompt_ids + sample.token_ids) == rendered_conversation(sample)
        assert len(sample.loss_mask) == len(sample.logprobs) == len(sample.token_ids)
        start = 0
        for turn in sample.turns:  # model tokens: mask 1 and a log-prob; the observation's: mask 0, log-prob 0
            model, observed = slice(start, start + turn.model_tokens), slice(start + turn.model_tokens,
                                                                             start + turn.model_tokens + turn.observation_tokens)
            assert set(sample.loss_mask[model]) == {1} and all(lp < 0 for lp in sample.logprobs[model])
            assert set(sample.loss_mask[observed]) == {0} and set(sample.logprobs[observed]) == {0.0}
            assert turn.step_status == "ok" and turn.observation_tokens > 0
            start = observed.stop
        assert start == len(sample.token_ids)
        assert sample.env_reward == pytest.approx(0.75)
    registry = rollout.server.service.registry
    assert registry.get_sample_value("rlfabric_rollout_agent_samples_total", {"status": "max_turns"}) >= 4
    assert registry.get_sample_value("rlfabric_rollout_agent_turns_total") >= 12
    assert registry.get_sample_value("rlfabric_rollout_env_step_seconds_count") >= 12


@pytest.mark.slow  # starts a vLLM engine
def test_the_vllm_engine_runs_the_same_agent_loops(mesh, vllm_served, monkeypatch):
    """Each turn is an ordinary generate request, so vLLM (prefix caching on) serves multi-turn as hf does."""
    env, _, _ = mesh
    _, channel, engine = vllm_served
    # The shared vLLM replica calls only environments its config names: this test's, for its duration.
    monkeypatch.setattr(engine.config.rollout.multi_turn, "allowed_env_addresses", [env.address])
    samples = agent_generate(channel, ["agent-rollout-again"] * 2, n=2, env_address=env.address)
    for sample in samples:
        assert (sample.agent_status, len(sample.turns)) == (MAX_TURNS, 3)
        assert TOKENIZER.decode(sample.prompt_ids + sample.token_ids) == rendered_conversation(sample)
        assert len(sample.loss_mask) == len(sample.logprobs) == len(sample.token_ids)


def test_max_total_tokens_bounds_model_and_environment_tokens_together(mesh):
    _, _, channel = mesh
    for sample in agent_generate(channel, ["agent-rollout-again"] * 3, max_turns=8, max_total_tokens=20):
        assert len(sample.token_ids) <= 20 and sample.agent_status == "max_tokens"


def test_each_environment_failure_ends_its_own_sample_only(mesh):
    _, _, channel = mesh
    started = time.monotonic()
    environments = ["agent-rollout-again", "agent-rollout-garbage", "agent-rollout-sleepy", "chess"]
    again, garbage, sleepy, unknown = agent_generate(channel, environments, env_timeout_s=1.0)
    assert time.monotonic() - started < 15  # the sleepy environment's deadline, not its 10 s
    assert again.agent_status == MAX_TURNS and again.agent_error == ""
    assert garbage.agent_status == ENV_FAILED
    assert garbage.agent_error.startswith("Step: INVALID_ARGUMENT: env at ")
    assert "environment 'agent-rollout-garbage' returned a message with role 'assistant'" in garbage.agent_error
    assert sleepy.agent_status == ENV_FAILED and sleepy.agent_error.startswith("Step: DEADLINE_EXCEEDED")
    assert unknown.agent_status == ENV_FAILED and unknown.agent_error.startswith("Reset: INVALID_ARGUMENT")
    assert "unknown environment 'chess'" in unknown.agent_error
    assert unknown.prompt_ids and unknown.token_ids == []  # the prompt is kept, so the batch has the row


def test_a_dead_environment_service_fails_each_sample_within_its_deadline(mesh, dead_env_address):
    _, _, channel = mesh
    started = time.monotonic()
    samples = agent_generate(channel, ["agent-rollout-again"] * 2, env_address=dead_env_address, env_timeout_s=2.0)
    assert time.monotonic() - started < 10
    for sample in samples:
        assert sample.agent_status == ENV_FAILED
        assert sample.agent_error.startswith(("Reset: UNAVAILABLE", "Reset: DEADLINE_EXCEEDED")), sample.agent_error


@pytest.mark.parametrize("problem, expected", [
    ("token prompt", "prompt 0: a multi-turn prompt needs chat messages and a task"),
    ("tool call format", "multi_turn.tool_call_format 'xml' is not known"),
    ("max turns", "multi_turn.max_turns and max_total_tokens must be >= 1"),
    ("task without multi_turn", "prompt 0 has an environment task, but the request is not multi-turn"),
])
def test_bad_multi_turn_requests_are_invalid_argument(mesh, problem, expected):
    _, _, channel = mesh
    request = agent_request(["agent-rollout-again"])
    if problem == "token prompt":
        request.prompts[0].CopyFrom(rollout_pb2.Prompt(token_ids=[1, 2, 3]))
    elif problem == "tool call format":
        request.sampling_params.multi_turn.tool_call_format = "xml"
    elif problem == "max turns":
        request.sampling_params.multi_turn.max_turns = 0
    else:
        request.sampling_params.ClearField("multi_turn")
    with pytest.raises(grpc.RpcError) as error:
        stub(channel).Generate(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.value.details()
    assert len(agent_generate(channel, ["agent-rollout-again"], max_turns=1)) == 1  # and the service goes on


def test_multi_turn_fields_cross_the_wire_and_a_single_turn_sample_carries_none():
    from rlfabric.rollout.types import Finish, FinishedSample, TurnInfo

    turn = TurnInfo(3, 2, ["lookup", ""], "unknown_tool", 0.5, "stop", 4, 0.25)
    sample = FinishedSample(1, 2, [5, 6, 7, 8, 9], [-1.0, -2.0, -3.0, 0.0, 0.0], Finish.STOP, 4, "text",
                            prompt_ids=[1, 2], loss_mask=[1, 1, 1, 0, 0], turns=[turn], agent_status="max_turns",
                            agent_error="", env_reward=0.5)
    decoded = wire.sample_from_proto(wire.sample_to_proto(sample))
    assert (decoded.token_ids.dtype, decoded.logprobs.dtype, decoded.loss_mask.dtype) == (np.int64, np.float32, np.int32)
    assert listed(wire.sample_to_proto(sample)) == sample  # and the same values
    single = FinishedSample(0, 0, [5, 6], [-1.0, -2.0], Finish.LENGTH, 1, "hi")
    on_wire = wire.sample_to_proto(single)
    assert not (on_wire.prompt_token_ids or on_wire.loss_mask or on_wire.turns or on_wire.agent_status)
    assert listed(on_wire) == single and single.model_token_mask() == [1, 1]
    prompt = AgentPrompt(QUESTION, AgentTask("lookup", "7", {"tools_kwargs": {"lookup": {}}}))
    assert wire.prompt_from_proto(wire.prompt_to_proto(prompt)) == prompt
    spec = SamplingSpec(n=2, max_tokens=9, multi_turn=MultiTurnSpec("h:1", 3, 50, "hermes", 2.5))
    assert wire.sampling_from_proto(wire.sampling_to_proto(spec)) == spec


def test_bad_tool_calls_and_environment_latency_are_counted():
    from prometheus_client import CollectorRegistry

    from rlfabric.coordinator.multi_turn import agent_metrics
    from rlfabric.rollout.servicer import RolloutMetrics
    from rlfabric.rollout.types import EngineStatus, Finish, FinishedSample, TurnInfo

    turns = [TurnInfo(5, 4, ["lookup"], "unknown_tool", 0.0, "stop", 1, 0.5),
             TurnInfo(5, 4, ["", "lookup"], "invalid_arguments", 0.0, "stop", 1, 0.25),
             TurnInfo(3, 0, [], "ok", 1.0, "stop", 1, 0.25)]
    good = FinishedSample(0, 0, [1] * 21, [0.0] * 21, Finish.STOP, 1, prompt_ids=[1], loss_mask=[1] * 13 + [0] * 8,
                          turns=turns, agent_status="done", env_reward=1.0)
    failed = FinishedSample(0, 1, [], [], Finish.STOP, 1, prompt_ids=[1], agent_status="env_failed",
                            agent_error="Reset: UNAVAILABLE: down")
    registry = CollectorRegistry()
    metrics = RolloutMetrics(registry, engine=SimpleNamespace(status=lambda: EngineStatus("hf", "tiny")))
    for sample in (good, failed):
        metrics.agent_sample(sample)
    value = registry.get_sample_value
    assert value("rlfabric_rollout_tool_calls_total", {"status": "unknown_tool"}) == 1
    assert value("rlfabric_rollout_tool_calls_total", {"status": "invalid_arguments"}) == 2
    assert value("rlfabric_rollout_agent_samples_total", {"status": "env_failed"}) == 1
    assert value("rlfabric_rollout_agent_turns_total") == 3
    assert value("rlfabric_rollout_env_step_seconds_count") == 3 and value("rlfabric_rollout_env_step_seconds_sum") == 1.0
    step = agent_metrics([good, failed])
    assert step["agent/turns/mean"] == 1.5 and step["agent/tool_calls/mean"] == 1.5
    assert step["agent/tool_calls/failed_fraction"] == 1.0 and step["agent/env_failed/count"] == 1
    assert step["agent/env_seconds/mean"] == pytest.approx(1 / 3) and step["agent/status/done/fraction"] == 0.5
    assert step["agent/model_token_fraction"] == pytest.approx(13 / 21)
