"""The agent loop, token in and token out: the ids the model sampled are kept as sampled, the
environment's observations are appended as ids tokenized once, the loss mask, log-probs and weight
versions line up with them, and a failing environment fails its sample only (status env_failed),
never the caller. Scripted turns on the tiny model's tokenizer, then the real HF engine on the tiny model."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from rlfabric.core.config import EnvConfig, RunConfig
from rlfabric.core.errors import Unavailable
from rlfabric.env import Environment, register_environment
from rlfabric.env.client import EnvClient, LocalEnvClient
from rlfabric.env.engine import EnvEngine
from rlfabric.env.items import Message, StepResult, Task, ToolCall
from rlfabric.env.lookup import LOOKUP_SPEC
from rlfabric.env.servicer import build_service as build_env_service
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.rollout.agent_loop import (
    DONE,
    ENV_FAILED,
    ENV_TOKEN_VERSION,
    MAX_TOKENS,
    MAX_TURNS,
    AgentLoop,
    AgentLoopLimits,
    EngineTurns,
    Trajectory,
    parse_tool_calls,
    render_prompt,
)
from rlfabric.rollout.types import Finish, FinishedSample, SamplingSpec
from tests.conftest import closed_port

TOKENIZER = build_tokenizer()
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
QUESTION = [{"role": "user", "content": "Look up key q and answer with #### and the number."}]
LOOKUP_TASK = Task("lookup", QUESTION[0]["content"], "7",
                   {"tools_kwargs": {"lookup": {"create_kwargs": {"table": {"q": "7"}}}}})
LOOKUP_CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "q"}}</tool_call>'


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class ScriptedTurns:
    """A TurnGenerator that answers turn k with script[k] (ids; EOS appended unless cut), log-prob
    -0.5 - k/10 per token and weight version 3 + k; it records the prompts it was given."""

    def __init__(self, *script: list[int] | str, cut: bool = False):
        self.script = [ids(turn) if isinstance(turn, str) else turn for turn in script]
        self.cut = cut
        self.prompts: list[list[int]] = []

    async def generate_turn(self, prompt_ids, max_tokens):
        turn = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        tokens = self.script[turn] if self.cut else self.script[turn] + [IM_END]
        tokens = tokens[:max_tokens]
        reason = Finish.STOP if tokens[-1] == IM_END else Finish.LENGTH
        return FinishedSample(0, 0, tokens, [-0.5 - turn / 10] * len(tokens), reason, 3 + turn)


@pytest.fixture
def env():
    """Runs f(client) with a LocalEnvClient on a started engine (its config's fields as keywords)."""

    def run(scenario, **fields):
        async def main():
            engine = EnvEngine(EnvConfig(**fields))
            await engine.start()
            try:
                return await scenario(LocalEnvClient(engine))
            finally:
                await engine.stop()

        return asyncio.run(main())

    return run


def loop(generator, client, **limits) -> AgentLoop:
    return AgentLoop(generator, client, TOKENIZER, AgentLoopLimits(**limits))


# --- parsing tool calls ---


def test_parse_hermes_tool_calls():
    text = ('I will look. <tool_call>{"name": "lookup", "arguments": {"key": "q"}}</tool_call>\n'
            '<tool_call> {"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"} </tool_call>')
    assert parse_tool_calls(text) == (ToolCall("lookup", '{"key": "q"}'), ToolCall("calculator", '{"expression": "1+1"}'))
    assert parse_tool_calls("#### 7") == ()
    assert parse_tool_calls('<tool_call>{"name": "lookup"}</tool_call>') == (ToolCall("lookup", "{}"),)


@pytest.mark.parametrize("body", ['{"name": lookup}', '["lookup"]', '{"arguments": {}}', '{"name": ""}'])
def test_a_malformed_tool_call_keeps_its_raw_text_and_no_name(body):
    assert parse_tool_calls(f"<tool_call>{body}</tool_call>") == (ToolCall("", body),)


def test_an_unclosed_tool_call_is_malformed():
    assert parse_tool_calls('<tool_call>{"name": "lookup", "argu') == (ToolCall("", '{"name": "lookup", "argu'),)


# --- token in, token out ---


def test_a_tool_call_episode_is_exact_token_in_token_out(env):
    generator = ScriptedTurns(LOOKUP_CALL, "#### 7")
    trajectory = env(lambda client: loop(generator, client).run(QUESTION, LOOKUP_TASK))
    assert (trajectory.status, trajectory.reward, trajectory.error) == (DONE, 1.0, "")

    # The prompt: the chat template with the session's tools, rendered once.
    assert trajectory.prompt_ids == generator.prompts[0]
    # Turn 2 was generated from exactly the ids so far: prompt, turn 1 as sampled, the observation's ids.
    turn1 = ids(LOOKUP_CALL) + [IM_END]
    observation = ids("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
    assert generator.prompts[1] == trajectory.prompt_ids + turn1 + observation
    turn2 = ids("#### 7") + [IM_END]
    assert trajectory.response_ids == turn1 + observation + turn2

    # The masks and per-token lists line up: model tokens 1 with their log-prob and version, env tokens 0.
    assert trajectory.loss_mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert trajectory.logprobs == [-0.5] * len(turn1) + [0.0] * len(observation) + [-0.6] * len(turn2)
    assert trajectory.weight_versions == [3] * len(turn1) + [ENV_TOKEN_VERSION] * len(observation) + [4] * len(turn2)
    assert [(t.model_tokens, t.observation_tokens, t.tool_calls, t.step_status, t.reward) for t in trajectory.turns] == [
        (len(turn1), len(observation), ["lookup"], "ok", 0.0), (len(turn2), 0, [], "ok", 1.0)]

    # Per-token versions as a FinishedSample carries them: each turn under its own, the observation under
    # turn 1's; the oldest token's is weight_version.
    assert trajectory.versions(default=0) == (3, [(3, 0), (4, len(turn1) + len(observation))])

    # The whole is the chat template's rendering of the conversation (its last newline aside).
    conversation = [*QUESTION, {"role": "assistant", "content": LOOKUP_CALL}, {"role": "tool", "content": "7"},
                    {"role": "assistant", "content": "#### 7"}]
    rendered = TOKENIZER.apply_chat_template(conversation, tokenize=False)
    assert TOKENIZER.decode(trajectory.prompt_ids + trajectory.response_ids) + "\n" == rendered


def test_sampled_ids_are_kept_even_where_re_tokenizing_would_change_them(env):
    # The model spells "<|im_end|>" out in characters inside its answer: decoded and re-encoded, those
    # characters would become the one special token. The trajectory keeps what was sampled.
    spelled = [TOKENIZER.convert_tokens_to_ids(c) for c in "#### 7 <|im_end|>"]
    generator = ScriptedTurns(spelled)
    trajectory = env(lambda client: loop(generator, client).run(QUESTION, LOOKUP_TASK))
    assert trajectory.response_ids == spelled + [IM_END]
    re_encoded = ids(TOKENIZER.decode(trajectory.response_ids))
    assert re_encoded != trajectory.response_ids and len(re_encoded) < len(trajectory.response_ids)


def test_bad_tool_calls_are_observations_and_the_episode_goes_on(env):
    generator = ScriptedTurns('<tool_call>{"name": look</tool_call>', '<tool_call>{"name": "peek"}</tool_call>', "#### 3")
    trajectory = env(lambda client: loop(generator, client).run(QUESTION, LOOKUP_TASK))
    assert trajectory.status == DONE and trajectory.reward == 0.0
    assert [t.step_status for t in trajectory.turns] == ["invalid_arguments", "unknown_tool", "ok"]
    second_prompt = TOKENIZER.decode(generator.prompts[1])
    assert second_prompt.endswith("<|im_start|>tool\nerror: the tool call could not be parsed: "
                                  '{"name": look<|im_end|>\n<|im_start|>assistant\n')
    assert "unknown tool 'peek'; tools: lookup" in TOKENIZER.decode(generator.prompts[2])


def test_max_turns_and_max_total_tokens_end_the_trajectory(env):
    three_calls = ScriptedTurns(LOOKUP_CALL, LOOKUP_CALL, LOOKUP_CALL)
    trajectory = env(lambda client: loop(three_calls, client, max_turns=2).run(QUESTION, LOOKUP_TASK))
    assert (trajectory.status, len(trajectory.turns)) == (MAX_TURNS, 2)
    assert trajectory.loss_mask[-1] == 0  # ended after the observation of turn 2

    long_turn = ScriptedTurns("#" * 50, cut=True)
    trajectory = env(lambda client: loop(long_turn, client, max_total_tokens=20).run(QUESTION, LOOKUP_TASK))
    assert (trajectory.status, len(trajectory.response_ids)) == (MAX_TOKENS, 20)
    assert trajectory.turns[0].finish_reason == "length"

    no_room_for_the_observation = ScriptedTurns(LOOKUP_CALL)
    limit = len(ids(LOOKUP_CALL)) + 5
    trajectory = env(lambda client: loop(no_room_for_the_observation, client, max_total_tokens=limit).run(
        QUESTION, LOOKUP_TASK))
    assert trajectory.status == MAX_TOKENS and trajectory.loss_mask == [1] * (len(ids(LOOKUP_CALL)) + 1)


# --- failing environments fail their sample only ---

release = threading.Event()


class Hanging(Environment):
    def reset(self):
        return []

    def step(self, action):
        release.wait(10)
        return StepResult()


class Nonsense(Environment):
    def reset(self):
        return []

    def step(self, action):
        return StepResult(observation=[Message("assistant", "not yours to say")])


register_environment("agent-loop-hanging", lambda task, config: Hanging())
register_environment("agent-loop-nonsense", lambda task, config: Nonsense())


@pytest.fixture(autouse=True)
def release_hanging_steps():
    release.clear()
    yield
    release.set()


def test_a_slow_environment_fails_the_sample_after_its_deadline(env):
    async def sample(client):
        trajectory = await loop(ScriptedTurns("hi"), client, env_timeout_s=0.3).run(QUESTION, Task("agent-loop-hanging"))
        release.set()  # the step's thread ends now, not when the event loop shuts down
        return trajectory

    trajectory = env(sample)
    assert trajectory.status == ENV_FAILED
    assert trajectory.error == "Step: DEADLINE_EXCEEDED: the environment took longer than 0.3 s"
    assert trajectory.loss_mask == [1] * 3  # what was sampled stays, for the record


def test_a_slow_environment_over_grpc_is_past_its_deadline(serve_in_thread):
    server = serve_in_thread(build_env_service(RunConfig()))

    async def sample():
        async with EnvClient(server.address) as client:
            trajectory = await loop(ScriptedTurns("hi"), client, env_timeout_s=0.3).run(
                QUESTION, Task("agent-loop-hanging"))
        release.set()
        return trajectory

    trajectory = asyncio.run(sample())
    assert trajectory.status == ENV_FAILED
    assert trajectory.error.startswith(f"Step: DEADLINE_EXCEEDED: env at {server.address} (Step, deadline 0.3 s)")


def test_an_environment_nobody_listens_at_is_unavailable_not_past_a_deadline():
    """A refused connection: gRPC retries it until the call's deadline, and the sample says it never got through."""
    address = f"127.0.0.1:{closed_port()}"

    async def sample():
        async with EnvClient(address) as client:
            return await loop(ScriptedTurns("hi"), client, env_timeout_s=1).run(QUESTION, LOOKUP_TASK)

    trajectory = asyncio.run(sample())
    assert trajectory.status == ENV_FAILED
    assert trajectory.error.startswith(f"Reset: UNAVAILABLE: env at {address} (Reset): could not connect within "
                                       "the 1 s deadline"), trajectory.error


def test_an_environment_answering_garbage_or_unknown_fails_the_sample(env):
    garbage = env(lambda client: loop(ScriptedTurns("hi"), client).run(QUESTION, Task("agent-loop-nonsense")))
    assert garbage.status == ENV_FAILED and garbage.error.startswith(
        "Step: INVALID_ARGUMENT: environment 'agent-loop-nonsense' returned")
    unknown = env(lambda client: loop(ScriptedTurns("hi"), client).run(QUESTION, Task("chess")))
    assert unknown.status == ENV_FAILED and unknown.error.startswith("Reset: INVALID_ARGUMENT: unknown environment 'chess'")
    assert unknown.response_ids == []
    assert unknown.prompt_ids == render_prompt(TOKENIZER, QUESTION, [])  # the sample still has its prompt


def test_the_engine_failing_fails_the_request_not_as_the_environment(env):
    class Failing(ScriptedTurns):
        async def generate_turn(self, prompt_ids, max_tokens):
            raise Unavailable("hf engine failed: RuntimeError: CUDA error")

    with pytest.raises(Unavailable, match="CUDA error"):
        env(lambda client: loop(Failing(), client).run(QUESTION, LOOKUP_TASK))


def test_env_calls_of_different_samples_run_concurrently(env):
    count = 4
    barrier = threading.Barrier(count, timeout=10)  # passes only when every sample's Step runs at once

    class Meeting(Environment):
        def reset(self):
            return []

        def step(self, action):
            barrier.wait()
            return StepResult(reward=1.0, done=True)

    register_environment("agent-loop-meeting", lambda task, config: Meeting())

    async def samples(client):
        return await asyncio.gather(*(loop(ScriptedTurns("hi"), client).run(QUESTION, Task("agent-loop-meeting"))
                                      for _ in range(count)))

    assert [(t.status, t.reward) for t in env(samples)] == [(DONE, 1.0)] * count


# --- the real engine ---


class RecordedEngineTurns(EngineTurns):
    """The engine's turns, after a first turn forced to a tool call; keeps what the engine returned."""

    def __init__(self, engine, params, first_turn: list[int]):
        super().__init__(engine, params)
        self.first_turn = first_turn
        self.samples: list[tuple[list[int], FinishedSample]] = []

    async def generate_turn(self, prompt_ids, max_tokens):
        if not self.samples:
            sample = FinishedSample(0, 0, self.first_turn, [0.0] * len(self.first_turn), Finish.STOP, 0)
        else:
            sample = await super().generate_turn(prompt_ids, max_tokens)
        self.samples.append((list(prompt_ids), sample))
        return sample


def test_the_engine_continues_from_the_ids_so_far_and_its_samples_are_kept(env, tiny_model):
    from rlfabric.core.config import load_config
    from rlfabric.rollout.hf_engine import HFEngine

    engine = HFEngine(load_config(None, [f"model.path={tiny_model}"]))
    generator = RecordedEngineTurns(engine, SamplingSpec(temperature=1.0, seed=0), ids(LOOKUP_CALL) + [IM_END])

    async def scenario(client):
        await engine.start()
        try:
            return await loop(generator, client, max_turns=2, max_tokens_per_turn=12).run(QUESTION, LOOKUP_TASK)
        finally:
            await engine.stop()

    trajectory = env(scenario)
    assert len(generator.samples) == 2 and trajectory.status in (MAX_TURNS, DONE, MAX_TOKENS)
    (first_prompt, first), (second_prompt, second) = generator.samples
    assert first_prompt == render_prompt(TOKENIZER, QUESTION, [LOOKUP_SPEC])
    start = len(first.token_ids) + trajectory.turns[0].observation_tokens
    assert second_prompt == trajectory.prompt_ids + trajectory.response_ids[:start]
    assert trajectory.response_ids[start:start + len(second.token_ids)] == second.token_ids
    assert trajectory.logprobs[start:start + len(second.token_ids)] == second.logprobs
    assert all(p < 0 for p in second.logprobs) and set(trajectory.loss_mask[start:start + len(second.token_ids)]) == {1}
    assert trajectory.weight_versions[start] == engine.weight_version


def test_the_loop_renders_the_declared_tools_into_the_prompt():
    class ToolListingTokenizer:
        """The tiny tokenizer, with a template that lists the tools (as Qwen's does in its system turn)."""

        def __getattr__(self, name):
            return getattr(TOKENIZER, name)

        def apply_chat_template(self, messages, tools=None, **kwargs):
            listed = "" if not tools else "tools: " + json.dumps([t["function"]["name"] for t in tools]) + "\n"
            return listed + TOKENIZER.apply_chat_template(messages, **kwargs)

    prompt = render_prompt(ToolListingTokenizer(), QUESTION, [LOOKUP_SPEC])
    assert TOKENIZER.decode(prompt).startswith('tools: ["lookup"]\n<|im_start|>user\n')


def test_the_lookup_warm_start_demonstrates_episodes_as_the_loop_renders_them():
    import random

    from rlfabric.quickstart.lookup_warm_start import demonstration

    ids_, labels = demonstration(TOKENIZER, random.Random(0))
    prompt = render_prompt(TOKENIZER, [{"role": "user", "content": "Look up key m and answer with #### and the number."}],
                           [LOOKUP_SPEC])
    assert ids_[:len(prompt)] == prompt and set(labels[:len(prompt)]) == {-100}
    assert TOKENIZER.decode(ids_[len(prompt):]) == (
        '<tool_call>{"name": "lookup", "arguments": {"key": "m"}}</tool_call><|im_end|>\n<|im_start|>tool\n6<|im_end|>\n'
        "<|im_start|>assistant\n#### 6<|im_end|>")
    trained = TOKENIZER.decode([t for t, label in zip(ids_, labels, strict=True) if label != -100])
    assert trained == '<tool_call>{"name": "lookup", "arguments": {"key": "m"}}</tool_call><|im_end|>#### 6<|im_end|>'


class PartialFirstTurn(ScriptedTurns):
    """ScriptedTurns whose first turn was a partial rollout: its first two tokens under version 2, the rest
    under 3 (a weight switch reached it mid-generation)."""

    async def generate_turn(self, prompt_ids, max_tokens):
        sample = await super().generate_turn(prompt_ids, max_tokens)
        if len(self.prompts) == 1:
            sample.weight_version, sample.version_spans = 2, [(2, 0), (3, 2)]
        return sample


def test_a_partial_rollout_turn_keeps_its_version_spans(env):
    trajectory = env(lambda client: loop(PartialFirstTurn(LOOKUP_CALL, "#### 7"), client).run(QUESTION, LOOKUP_TASK))
    first, second = trajectory.turns
    turn1, observation, turn2 = first.model_tokens, first.observation_tokens, second.model_tokens
    weight_version, spans = trajectory.versions(default=0)
    assert (weight_version, spans) == (2, [(2, 0), (3, 2), (4, turn1 + observation)])
    sample = FinishedSample(0, 0, trajectory.response_ids, trajectory.logprobs, Finish.STOP, weight_version,
                            version_spans=spans)
    assert sample.token_versions() == [2, 2] + [3] * (turn1 - 2 + observation) + [4] * turn2
    assert min(sample.token_versions()) == sample.weight_version and sample.newest_version == 4


def test_a_trajectory_of_one_version_has_no_spans():
    trajectory = Trajectory([1, 2])
    trajectory.append([5, 6], model=True, logprobs=[-0.1, -0.2], version=7)
    trajectory.append([8], model=False)
    trajectory.append([9], model=True, logprobs=[-0.3], version=7)
    assert trajectory.versions(default=0) == (7, [])
    assert Trajectory([1]).versions(default=9) == (9, [])  # no model token: the engine's version
