"""Multi-turn token in, token out on a real chat model: SmolLM2-135M-Instruct (hf engine, CPU) in agent
loops against an environment that answers every turn, so each trajectory crosses several turn
boundaries. The trajectory's ids are the chat template's rendering of the whole conversation: each
observation exactly the template's tokens for it, each model turn exactly what was sampled."""

from __future__ import annotations

import asyncio

import pytest

from rlfabric.core.config import EnvConfig, load_config
from rlfabric.env import Environment, register_environment
from rlfabric.env.client import LocalEnvClient
from rlfabric.env.engine import EnvEngine
from rlfabric.env.items import Message, StepResult
from rlfabric.rollout.agent_rollout import AgentRollouts
from rlfabric.rollout.hf_engine import HFEngine
from rlfabric.rollout.types import AgentPrompt, AgentTask, MultiTurnSpec, SamplingSpec

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}]
FOLLOW_UP = "Are you sure? Answer with just the number."


class AskAgain(Environment):
    """Answers each turn with the same user follow-up (as a tool would with its output); never done."""

    def reset(self):
        return []

    def step(self, action):
        return StepResult([Message("user", FOLLOW_UP)])


register_environment("smollm2-ask-again", lambda task, config: AskAgain())


def test_a_multi_turn_trajectory_is_the_rendered_conversation(smollm2):
    engine = HFEngine(load_config(None, [f"model.path={smollm2}", "rollout.max_num_seqs=4"]))
    env = EnvEngine(EnvConfig())
    # Greedy: SmolLM2's replies to these are short, so each turn ends with the end-of-turn token it samples.
    spec = SamplingSpec(n=1, max_tokens=48, temperature=0.0,
                        multi_turn=MultiTurnSpec(max_turns=3, max_total_tokens=300))

    async def scenario():
        await engine.start()
        await env.start()
        try:
            agents = AgentRollouts(engine, engine.config, LocalEnvClient(env))
            prompt = AgentPrompt(QUESTION, AgentTask("smollm2-ask-again"))
            return [sample async for sample in agents.generate([prompt], spec)]
        finally:
            await env.stop()
            await engine.stop()

    samples = asyncio.run(scenario())
    tokenizer = engine.tokenizer
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(samples) == 1 and len(samples[0].turns) == 3
    for sample in samples:
        conversation, start, turns_ended = list(QUESTION), 0, 0
        for turn in sample.turns:
            turn_ids = sample.token_ids[start:start + turn.model_tokens]
            ended = turn_ids[-1] == end_of_turn
            turns_ended += ended
            conversation.append({"role": "assistant", "content": tokenizer.decode(turn_ids[:-1] if ended else turn_ids)})
            observed = sample.token_ids[start + turn.model_tokens:start + turn.model_tokens + turn.observation_tokens]
            if observed:  # exactly the template's tokens between this turn's text and the next turn
                conversation.append({"role": "user", "content": FOLLOW_UP})
                expected = ("" if ended else "<|im_end|>") + f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
                assert observed == tokenizer.encode(expected, add_special_tokens=False)
                assert set(sample.loss_mask[start + turn.model_tokens:start + turn.model_tokens + len(observed)]) == {0}
            start += turn.model_tokens + turn.observation_tokens
        assert turns_ended == 3  # every turn crossed the end-of-turn boundary the model sampled
        text = tokenizer.decode(sample.prompt_ids + sample.token_ids)
        if observed:  # it ends with an observation and the next assistant header
            assert text == tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        else:  # it ends with a model turn: the template closes it
            closing = ("" if ended else "<|im_end|>") + "\n"
            assert text + closing == tokenizer.apply_chat_template(conversation, tokenize=False)
        assert sample.prompt_ids == tokenizer.encode(
            tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
