"""MoE routing replay for samples built from several engine calls: a bfloat16 hf engine runs a tiny Qwen3-MoE
through three turns against the environment service (rollout.multi_turn), and through an agent's three chat calls
through the gateway (one segment); each call records the experts of every token it runs (its prompt pass too).
The routes are joined as the token ids are: every token keeps the routes of the first call that ran it, so a
sampled token has those of the call that sampled it, and a turn's last token and the tokens after it have those
of the next call's prompt pass. The float32 trainer then runs every trained token on them. Model as
tests/actor/test_router_replay.py's (16 experts, 4 per token, 4 layers)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch

from rlfabric import algorithms as algos
from rlfabric.coordinator.rollout_batch import build_rollout_batch
from rlfabric.core.config import EnvConfig
from rlfabric.core.router_replay import replay_routes, routers
from rlfabric.data.dataset import PromptRow
from rlfabric.env import Environment, register_environment
from rlfabric.env.client import LocalEnvClient
from rlfabric.env.engine import EnvEngine
from rlfabric.env.items import Message, StepResult
from rlfabric.rollout.agent_rollout import AgentRollouts
from rlfabric.rollout.types import AgentPrompt, AgentTask, MultiTurnSpec, SamplingSpec
from rlfabric.trainer.batch import ROUTES, validate_batch
from rlfabric.trainer.objectives import forward_log_probs
from tests.rollout.helpers import rollout_config

pytestmark = pytest.mark.slow

EXPERTS, TOP_K, LAYERS, N = 16, 4, 4, 2
QUESTION = [{"role": "user", "content": "Say something."}]
STOPS = tuple(range(5, 40))  # the tiny model's random turns end after a few tokens, with finish STOP
NONE = 255  # uint8 routes: a token no call ran


class Again(Environment):
    """Never done: every turn is answered "again"."""

    def reset(self):
        return []

    def step(self, action):
        return StepResult([Message("user", "again")])


register_environment("routes-again", lambda task, config: Again())


class CallLog:
    """The engine as multi-turn requests use it, keeping each call's prompt ids and sample."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[list[int], object]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompts, params):
        async for sample in self.engine.generate(prompts, params):
            self.calls.append((list(prompts[0]), sample))
            yield sample


@pytest.fixture(scope="module")
def multi_turn(tmp_path_factory):
    """(model path, 2 prompts x n=2 three-turn samples, every engine call)."""
    from rlfabric.quickstart.tiny_model import make_tiny_moe_model
    from rlfabric.rollout.hf_engine import HFEngine

    model = make_tiny_moe_model(tmp_path_factory.mktemp("turns-moe") / "moe", num_experts=EXPERTS,
                                experts_per_token=TOP_K, num_layers=LAYERS, initializer_range=0.1)
    config = rollout_config(model, "rollout.dtype=bfloat16", "actor.router_replay=true", "rollout.max_num_seqs=8")
    spec = SamplingSpec(n=N, max_tokens=12, temperature=1.0, seed=5, stop_token_ids=STOPS,
                        multi_turn=MultiTurnSpec(max_turns=3, max_total_tokens=200))
    prompts = [AgentPrompt(QUESTION, AgentTask("routes-again", "7", {})) for _ in range(2)]

    async def main():
        engine, env = HFEngine(config), EnvEngine(EnvConfig())
        await engine.start()
        await env.start()
        log = CallLog(engine)
        try:
            rollouts = AgentRollouts(log, config, env=LocalEnvClient(env))
            return [sample async for sample in rollouts.generate(prompts, spec)], log.calls
        finally:
            await env.stop()
            await engine.stop()

    samples, calls = asyncio.run(main())
    return model, samples, calls


def _calls_of(sample, calls) -> list[tuple[list[int], object]]:
    """The sample's engine calls, in order: those whose prompt and sampled ids start its ids."""
    ids = list(sample.prompt_ids) + list(sample.token_ids)
    own = [(prompt, s) for prompt, s in calls if ids[: len(prompt) + len(s.token_ids)] == prompt + list(s.token_ids)]
    return sorted(own, key=lambda call: len(call[0]))


def _check_joined(routes, ids: list[int], prompt_len: int, loss_mask, own: list) -> tuple[int, int, int, int]:
    """Asserts that each token of a joined sample (`ids`, its `routes`) has the routes of the first of its engine
    calls `own` [(prompt ids, sample)] that ran it; (trained tokens, those with routes, (token, layer) routes that a
    later call's prompt pass ran again, those it routed otherwise)."""
    assert routes.dtype == np.uint8 and routes.shape == (len(ids), LAYERS, TOP_K)
    assert np.array_equal(routes[: len(own[0][0])], own[0][1].routed_experts[: len(own[0][0])])
    passes = changes = 0
    for k, (prompt, call) in enumerate(own):
        end = len(prompt) + len(call.token_ids)  # the call ran its prompt and its sampled tokens but the last
        assert np.array_equal(routes[len(prompt) : end - 1], call.routed_experts[len(prompt) : end - 1])
        if k + 1 < len(own):  # its last token and the tokens after it: the next call's prompt pass
            next_prompt, next_call = own[k + 1]
            assert np.array_equal(routes[end - 1 : len(next_prompt)], next_call.routed_experts[end - 1 : len(next_prompt)])
            passes += (end - 1) * LAYERS
            changes += int((np.sort(next_call.routed_experts[: end - 1], -1) != np.sort(routes[: end - 1], -1))
                           .any(-1).sum())
        else:
            assert (routes[end - 1 :] == NONE).all()  # the last sampled token: no call ran it
    mask = np.asarray(loss_mask)
    replayed = int((routes[prompt_len:][mask == 1] != NONE).all((1, 2)).sum())
    return int(mask.sum()), replayed, passes, changes


def test_every_token_of_a_multi_turn_sample_keeps_the_routes_of_the_first_call_that_ran_it(multi_turn):
    _, samples, calls = multi_turn
    totals = np.zeros(4, dtype=np.int64)
    for sample in samples:
        own = _calls_of(sample, calls)
        assert len(own) == len(sample.turns) == 3  # every turn one call, each recording routes
        ids = list(sample.prompt_ids) + list(sample.token_ids)
        totals += _check_joined(sample.routed_experts, ids, len(sample.prompt_ids), sample.loss_mask, own)
    trained, replayed, passes, changes = totals.tolist()
    assert replayed == trained - len(samples)  # every trained token but each sample's last, which no call ran
    print(f"\n{replayed} of {trained} trained tokens replayed; later prompt passes chose other experts for "
          f"{changes} of {passes} (token, layer) routes of tokens an earlier call ran")


@pytest.fixture(scope="module")
def episode(multi_turn):
    """An agent's episode through the gateway (the openai SDK over loopback HTTP, a RolloutRouter over the hf
    engine on the tiny MoE model): three chat calls, each extending the one before; its record and mesh."""
    from openai import OpenAI

    from tests.gateway.helpers import GatewayMesh

    mesh = GatewayMesh(multi_turn[0], "rollout.dtype=bfloat16", "actor.router_replay=true")
    try:
        gateway = mesh.gateway
        opened = mesh.call(gateway.episodes.open)
        client = OpenAI(base_url=gateway.base_url, api_key=opened.key, max_retries=0)
        messages = [{"role": "user", "content": "task routes"}]
        for _ in range(3):
            reply = client.chat.completions.create(model="whatever", messages=messages, max_tokens=6)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        return mesh.call(gateway.episodes.close, opened.key), list(mesh.log)
    finally:
        mesh.stop()


def test_every_token_of_an_agent_segment_keeps_the_routes_of_the_first_call_that_ran_it(episode):
    record, log = episode
    (segment,) = record.segments
    sample = segment.to_sample(0, 0, lambda ids: "")
    own = sorted([(r.prompt_ids, r.sample) for r in log], key=lambda call: len(call[0]))
    assert len(own) == len(segment.calls) == 3
    trained, replayed, _, _ = _check_joined(sample.routed_experts, segment.ids(), len(segment.prompt_ids),
                                            segment.loss_mask, own)
    assert replayed == trained - 1 and trained == sum(len(call.token_ids) for call in record.calls)


def test_the_trainer_runs_every_trained_token_on_its_joined_routes(multi_turn):
    """The coordinator's batch of the multi-turn samples puts each token's routes at its place (own prompt ids,
    loss mask), and the float32 trainer replays them: 100% of the trained tokens' recorded routes."""
    from transformers import AutoModelForCausalLM

    model_path, samples, _ = multi_turn
    rows = [PromptRow(f"turns:{i}", "test", QUESTION, [], "", "", "") for i in range(2)]
    batch = build_rollout_batch(rows, samples, N, pad_token_id=0)
    checked = validate_batch({**batch.tensors, ROUTES: batch.routed_experts}, vocab_size=10**6)
    given = checked[ROUTES]  # [B, S, layers, top_k], -1 where none
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    used = []
    with torch.no_grad(), replay_routes(model, given.flatten(0, 1)) as agreement:
        hooks = [router.register_forward_hook(lambda _m, _a, out: used.append(out[2])) for router in routers(model)]
        replayed = forward_log_probs(model, checked, 1.0, False, False)[0]
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        plain = forward_log_probs(model, checked, 1.0, False, False)[0]
    used = torch.stack(used, 1).unflatten(0, given.shape[:2])  # [B, S, layers, top_k]
    response_len = checked.response_len
    trained = checked["response_mask"].bool()  # [B, T]
    routes_of_trained = given[:, -response_len:][trained]  # [trained tokens, layers, top_k]
    recorded = (routes_of_trained >= 0).all(-1).all(-1)
    assert int((~recorded).sum()) == len(samples)  # each sample's last token, which no call ran
    assert torch.equal(used[:, -response_len:][trained][recorded], routes_of_trained[recorded])
    matched, counted = agreement.totals()
    assert counted == int((given >= 0).all(-1).sum())
    gap = {name: algos.mismatch_metrics(log_probs, batch.rollout_log_probs, batch.response_mask)
           for name, log_probs in (("without", plain), ("with", replayed))}
    print(f"\nmulti-turn: {counted - matched} of {counted} recorded routes differ without replay; "
          f"|rollout - trainer| log-prob {gap['without']['rollout_corr/log_prob_abs_diff']:.4f} without, "
          f"{gap['with']['rollout_corr/log_prob_abs_diff']:.4f} with replay")
    assert counted - matched > 0, "bfloat16 against float32 left every route alone: the test shows nothing"
    assert gap["with"]["rollout_corr/log_prob_abs_diff"] < gap["without"]["rollout_corr/log_prob_abs_diff"]


def test_a_sample_whose_environment_failed_before_any_turn_leaves_the_others_replayed(multi_turn):
    """No engine call ran such a sample (its prompt only, no routes): the batch keeps the others' routes."""
    samples = sorted(multi_turn[1], key=lambda s: (s.prompt_index, s.sample_index))  # the batch's order
    failed = replace(samples[-1], token_ids=[], logprobs=[], loss_mask=[], turns=[], agent_status="env_failed",
                     routed_experts=None)
    rows = [PromptRow(f"turns:{i}", "test", QUESTION, [], "", "", "") for i in range(2)]
    batch = build_rollout_batch(rows, [*samples[:-1], failed], N, pad_token_id=0)
    real = batch.tensors["attention_mask"].bool()
    assert (batch.routed_experts[-1] == NONE).all()
    assert torch.equal(batch.routed_experts[:-1][real[:-1]],
                       torch.from_numpy(np.concatenate([s.routed_experts for s in samples[:-1]])))
