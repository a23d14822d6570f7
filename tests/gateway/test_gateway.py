"""The agent gateway end to end: the openai SDK over loopback HTTP, a real RolloutRouter over two in-process
replicas of the hf engine on the tiny model; each engine request logged on the replica's side."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import threading
import time
import tracemalloc

import httpx
import numpy as np
import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from rlfabric.gateway.calls import RouterGenerator
from rlfabric.gateway.segments import episode_advantages
from rlfabric.rollout.types import Finish
from tests.gateway.helpers import GatewayMesh
from tests.rollout.helpers import original_weights
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def mesh(tiny_model):
    mesh = GatewayMesh(tiny_model)
    yield mesh
    mesh.stop()


def client_of(gateway, episode, **kwargs) -> OpenAI:
    return OpenAI(base_url=gateway.base_url, api_key=episode.key, max_retries=0, **kwargs)


def reply_message(reply) -> dict:
    """The assistant message as an agent appends it to its history, through JSON."""
    return json.loads(json.dumps(reply.choices[0].message.model_dump(exclude_none=True)))


def run_agent(client: OpenAI, tag: str, turns: int, summarise_after: int | None = None) -> list[dict]:
    """A chat agent: `turns` calls, its history round-tripped through JSON; after `summarise_after` calls it
    replaces its history with a summary (a new conversation)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"task {tag}"}]
    for turn in range(turns):
        reply = client.chat.completions.create(model="whatever", messages=messages, max_tokens=6)
        messages = messages + [reply_message(reply), {"role": "user", "content": f"go on {turn}"}]
        if summarise_after is not None and turn + 1 == summarise_after:
            messages = [{"role": "user", "content": f"summary of task {tag}: {len(messages)} messages"}]
    return messages


def check_token_exact(mesh, record) -> None:
    """Each engine request of the episode consumed a prefix of its segment and sampled the segment's next
    tokens: ids, mask 1, log-probs and versions as the engine returned them."""
    for segment in record.segments:
        requests = mesh.requests_of([segment.prompt_ids])
        requests = [r for r in requests if r.prompt_ids == segment.ids()[:len(r.prompt_ids)]]
        assert len(requests) == len(segment.calls)
        for request in requests:
            start = len(request.prompt_ids) - len(segment.prompt_ids)
            end = start + len(request.sample.token_ids)
            assert segment.token_ids[start:end] == request.sample.token_ids.tolist()
            assert segment.loss_mask[start:end] == [1] * (end - start)
            assert segment.logprobs[start:end] == request.sample.logprobs.tolist()
            assert segment.token_versions[start:end] == request.sample.token_versions()
    sampled = sum(len(call.token_ids) for call in record.calls)
    assert sum(sum(segment.loss_mask) for segment in record.segments) == sampled > 0


def test_a_history_round_tripped_through_json_is_one_segment_of_the_engines_own_ids(mesh):
    gateway = mesh.gateway
    episode = mesh.call(gateway.episodes.open)
    run_agent(client_of(gateway, episode), "json-round-trip", turns=3)
    record = mesh.call(gateway.episodes.close, episode.key)
    assert [call.parent for call in record.calls] == [None, 0, 1]
    (segment,) = record.segments
    first = mesh.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "task json-round-trip"}],
        add_generation_prompt=True, tokenize=False)
    assert segment.prompt_ids == mesh.tokenizer.encode(first, add_special_tokens=False)
    check_token_exact(mesh, record)
    # The tokens between turns are the template's, not sampled: masked.
    assert 0 in segment.loss_mask and segment.calls == [0, 1, 2]
    # The episode's requests all went to one replica (its routing key).
    assert len({r.replica for r in mesh.requests_of([segment.prompt_ids])}) == 1


def test_a_summarising_agent_gives_two_segments_that_share_the_episodes_advantage(mesh):
    gateway = mesh.gateway
    episode = mesh.call(gateway.episodes.open)
    run_agent(client_of(gateway, episode), "summarise", turns=4, summarise_after=2)
    record = mesh.call(gateway.episodes.close, episode.key)
    assert [call.parent for call in record.calls] == [None, 0, None, 2]
    assert [segment.calls for segment in record.segments] == [[0, 1], [2, 3]]
    check_token_exact(mesh, record)
    # Advantages per episode: this one (two segments) and another of the same prompt with one.
    longest = max(len(s.token_ids) for s in record.segments)
    mask = torch.tensor([s.loss_mask + [0] * (longest - len(s.loss_mask)) for s in record.segments] + [[1] * longest])
    advantages = episode_advantages("grpo", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                    torch.tensor([0, 0, 1]), mask)
    first, second = (advantages[i][mask[i].bool()] for i in (0, 1))
    assert torch.all(first == first[0]) and torch.all(second == first[0]) and first[0] > 0
    assert advantages[2, 0] == -first[0]  # two episodes, not three rows: +a and -a


def test_weights_that_move_mid_episode_give_each_token_the_version_that_sampled_it(mesh):
    gateway = mesh.gateway
    episode = mesh.call(gateway.episodes.open)
    client = client_of(gateway, episode)
    messages = [{"role": "user", "content": "versions"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    version = mesh.run(mesh.engine.load_weights(original_weights(mesh.model_path).items()))  # a new version
    client.chat.completions.create(model="m", max_tokens=4,
                                   messages=messages + [reply_message(first), {"role": "user", "content": "and"}])
    record = mesh.call(gateway.episodes.close, episode.key)
    (segment,) = record.segments
    assert [set(call.token_versions) for call in record.calls] == [{version - 1}, {version}]
    sample = segment.to_sample(0, 0, mesh.tokenizer.decode)
    assert (sample.weight_version, sample.newest_version) == (version - 1, version)  # staleness: the oldest token
    assert sample.token_versions() == segment.token_versions
    check_token_exact(mesh, record)


def test_a_call_that_pause_with_abort_ends_is_held_until_resume_and_answered(mesh):
    """Pause(abort=True) ends the call the gate held (an empty Finish.ABORT sample): the gateway sends it
    again, the gate holds it again, and Resume lets it through. The agent sees one answer, no error."""
    gateway, engine = mesh.gateway, mesh.engine
    episode = mesh.call(gateway.episodes.open)
    resumed_before = gateway.calls.counts["calls_resumed"]
    replies = []
    call = threading.Thread(target=lambda: replies.append(client_of(gateway, episode).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "paused"}], max_tokens=4)))
    mesh.run(engine.pause(abort=False))
    try:
        call.start()
        wait_until(lambda: mesh.call(engine.status).queue_depth == 1, 30, "the call held at the gate")
        assert mesh.run(engine.pause(abort=True)) == 1
        wait_until(lambda: gateway.calls.counts["calls_resumed"] == resumed_before + 1, 30, "the call sent again")
        wait_until(lambda: mesh.call(engine.status).queue_depth == 1, 30, "the call held again")
        assert call.is_alive() and not replies
    finally:
        mesh.run(engine.resume())
    call.join(60)
    record = mesh.call(gateway.episodes.close, episode.key)
    (recorded,) = record.calls
    (reply,) = replies
    assert reply.choices[0].message.content == recorded.text and reply.choices[0].finish_reason != "abort"
    assert reply.usage.completion_tokens == len(recorded.token_ids) > 0
    # The engine's two requests: the one the abort ended, with nothing sampled, then the one answered.
    aborted, answered = mesh.requests_of([recorded.prompt_ids])
    assert aborted.sample.finish_reason == Finish.ABORT and len(aborted.sample.token_ids) == 0
    assert list(answered.prompt_ids) == recorded.prompt_ids
    assert np.asarray(answered.sample.token_ids).tolist() == recorded.token_ids  # numpy arrays, or lists
    assert np.asarray(answered.sample.logprobs).tolist() == recorded.logprobs


class AbortedOnce(RouterGenerator):
    """The router's generator, but its first call ends as Pause(abort=True) ends a call in flight: after its
    first `kept` tokens (Finish.ABORT), and a weight sync lands before the engine is asked again."""

    def __init__(self, router, engine, model_path, kept: int):
        super().__init__(router)
        self.engine, self.model_path, self.kept, self.requests = engine, model_path, kept, []

    async def generate(self, prompt_ids, params, routing_key):
        self.requests.append((list(prompt_ids), params.max_tokens))
        sample = await super().generate(prompt_ids, params, routing_key)
        if len(self.requests) > 1:
            return sample
        await self.engine.load_weights(original_weights(self.model_path).items())
        return dataclasses.replace(sample, token_ids=sample.token_ids[:self.kept], logprobs=sample.logprobs[:self.kept],
                                   finish_reason=Finish.ABORT)


def test_a_call_aborted_mid_generation_goes_on_from_its_tokens_under_the_new_weights(mesh):
    generator = AbortedOnce(mesh.router, mesh.engine, mesh.model_path, kept=2)
    gateway = mesh.gateway_with("agent.gateway.max_tokens_per_call=6", generator=generator)
    episode = mesh.call(gateway.episodes.open)
    reply = client_of(gateway, episode).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "aborted mid-way"}], max_tokens=6)
    record = mesh.call(gateway.episodes.close, episode.key)
    (call,) = record.calls
    (prompt, asked), (continued, asked_after) = generator.requests
    # The second request is the prompt and the two tokens sampled, for the tokens left.
    assert continued == prompt + call.token_ids[:2] and (asked, asked_after) == (6, 4)
    version = mesh.call(lambda: mesh.engine.weight_version)
    assert call.token_versions == [version - 1] * 2 + [version] * (len(call.token_ids) - 2)
    assert len(call.logprobs) == len(call.token_ids) == reply.usage.completion_tokens > 2
    assert call.finish_reason != Finish.ABORT and gateway.calls.counts["calls_resumed"] == 1
    (segment,) = record.segments
    assert segment.to_sample(0, 0, mesh.tokenizer.decode).version_spans == [(version - 1, 0), (version, 2)]


def _stream_agent(client: OpenAI, tag: str) -> tuple[list[str], list[list[int]]]:
    """Two streamed turns: the messages as the client assembles them, and the token ids the chunks carried."""
    messages, contents, ids = [{"role": "user", "content": f"stream {tag}"}], [], []
    for turn in range(2):
        content, token_ids = "", []
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=6, stream=True,
                                                logprobs=True, extra_body={"return_token_ids": True})
        for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                token_ids += (choice.model_extra or {}).get("token_ids") or []
        contents.append(content)
        ids.append(token_ids)
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"and {turn}"}]
    return contents, ids


def _plain_agent(client: OpenAI, tag: str) -> tuple[list[str], list[list[int]]]:
    messages, contents, ids = [{"role": "user", "content": f"stream {tag}"}], [], []
    for turn in range(2):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=6, logprobs=True,
                                               extra_body={"return_token_ids": True})
        contents.append(reply.choices[0].message.content)
        ids.append(reply.choices[0].model_extra["token_ids"])
        assert len(reply.choices[0].logprobs.content) == len(ids[-1])
        messages += [reply_message(reply), {"role": "user", "content": f"and {turn}"}]
    return contents, ids


def test_stream_and_plain_calls_record_the_same_ids_and_assemble_the_same_messages(mesh):
    gateway = mesh.gateway
    results = []
    for agent in (_stream_agent, _plain_agent):
        episode = mesh.call(gateway.episodes.open, 1234)  # the same seed: the same samples
        contents, ids = agent(client_of(gateway, episode), "same")
        record = mesh.call(gateway.episodes.close, episode.key)
        assert ids == [call.token_ids for call in record.calls]
        results.append((contents, [(c.prompt_ids, c.token_ids, c.logprobs) for c in record.calls],
                        len(record.segments)))
    assert results[0] == results[1]
    assert results[0][2] == 1


def test_wrong_key_401_closed_episode_410_and_nothing_recorded(mesh):
    gateway = mesh.gateway
    with pytest.raises(openai.AuthenticationError) as unknown:
        OpenAI(base_url=gateway.base_url, api_key="not-a-key", max_retries=0).models.list()
    assert unknown.value.status_code == 401 and unknown.value.body["code"] == "invalid_api_key"
    episode = mesh.call(gateway.episodes.open)
    client = client_of(gateway, episode)
    assert [model.id for model in client.models.list()] == [gateway.model]
    record = mesh.call(gateway.episodes.close, episode.key)
    requests_before = len(mesh.log)
    with pytest.raises(openai.APIStatusError) as closed:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "late"}], max_tokens=2)
    assert closed.value.status_code == 410 and closed.value.body["code"] == "episode_closed"
    assert record.calls == [] and len(mesh.log) == requests_before


def test_a_retried_request_is_answered_from_the_record(mesh):
    gateway = mesh.gateway
    episode = mesh.call(gateway.episodes.open)
    url, auth = f"{gateway.base_url}/chat/completions", {"Authorization": f"Bearer {episode.key}"}
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "retry me"}], "max_tokens": 5,
                       "temperature": 1.0})
    first = httpx.post(url, content=body, headers=auth, timeout=60).json()
    again = httpx.post(url, content=body, headers={**auth, "x-stainless-retry-count": "1"}, timeout=60).json()
    assert again["id"] == first["id"] and again["choices"] == first["choices"]
    assert len(mesh.call(lambda: list(episode.calls))) == 1
    httpx.post(url, content=body, headers=auth, timeout=60).raise_for_status()  # not a retry: sampled again
    record = mesh.call(gateway.episodes.close, episode.key)
    assert len(record.calls) == 2 and record.calls[1].parent is None


def test_the_path_form_carries_the_key_for_clients_whose_key_is_fixed(mesh):
    gateway = mesh.gateway
    episode = mesh.call(gateway.episodes.open)
    client = OpenAI(base_url=gateway.episode_url(episode), api_key="EMPTY", max_retries=0)
    completion = client.completions.create(model="m", prompt=[1, 40, 41, 42], max_tokens=4,
                                           extra_body={"return_token_ids": True})
    ids = completion.choices[0].model_extra["token_ids"]
    follow = client.completions.create(model="m", prompt=[1, 40, 41, 42, *ids, 43], max_tokens=4)
    record = mesh.call(gateway.episodes.close, episode.key)
    assert [len(s.calls) for s in record.segments] == [2]  # token-id prompts that extend: one segment
    assert record.calls[1].text == follow.choices[0].text
    check_token_exact(mesh, record)


def test_unsupported_requests_are_400_in_openais_format(mesh):
    gateway = mesh.gateway
    episode = mesh.call(gateway.episodes.open)
    client = client_of(gateway, episode)
    messages = [{"role": "user", "content": "x"}]
    for extra, param in [({"n": 2}, "n"), ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"top_logprobs": 3, "logprobs": True}, "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=messages, **extra)
        assert refused.value.body["param"] == param and refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as robot:
        client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
    assert robot.value.body["param"] == "messages.0.role"
    assert mesh.call(gateway.episodes.close, episode.key).calls == []
    # OpenAI's developer role is the system prompt.
    episode = mesh.call(gateway.episodes.open)
    client_of(gateway, episode).chat.completions.create(
        model="m", max_tokens=1, messages=[{"role": "developer", "content": "dev"}, {"role": "user", "content": "u"}])
    (call,) = mesh.call(gateway.episodes.close, episode.key).calls
    assert mesh.tokenizer.decode(call.prompt_ids).startswith("<|im_start|>system\ndev<|im_end|>")


def test_agent_sampling_settings_are_replaced_by_the_runs_and_counted(mesh):
    gateway = mesh.gateway
    mesh.call(gateway.calls.take_metrics)
    episode = mesh.call(gateway.episodes.open)
    client = client_of(gateway, episode)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "cold"}], max_tokens=3,
                                   temperature=0.2, top_p=0.5)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "as run"}], max_tokens=3)
    record = mesh.call(gateway.episodes.close, episode.key)
    metrics = mesh.call(gateway.calls.take_metrics)
    assert metrics["agent/sampling_overrides"] == 1 and metrics["agent/calls"] == 2
    (request,) = mesh.requests_of([record.calls[0].prompt_ids])
    assert (request.params.temperature, request.params.top_p) == (1.0, 1.0)


def test_the_config_can_let_agents_choose_their_sampling(mesh):
    gateway = mesh.gateway_with("agent.gateway.honour_agent_sampling=true")
    episode = mesh.call(gateway.episodes.open)
    client_of(gateway, episode).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "honoured"}], max_tokens=2, temperature=0.25)
    (call,) = mesh.call(gateway.episodes.close, episode.key).calls
    (request,) = mesh.requests_of([call.prompt_ids])
    assert request.params.temperature == 0.25


def test_limits_per_episode_and_in_flight(mesh):
    gateway = mesh.gateway_with("agent.gateway.max_calls_per_episode=2", "agent.gateway.max_tokens_per_episode=7")
    episode = mesh.call(gateway.episodes.open)
    client = client_of(gateway, episode)
    ask = dict(model="m", messages=[{"role": "user", "content": "limits"}], max_tokens=5)
    first = client.chat.completions.create(**ask)
    second = client.chat.completions.create(**{**ask, "messages": [{"role": "user", "content": "two"}]})
    assert first.usage.completion_tokens <= 5 and second.usage.completion_tokens <= 7 - first.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as third:
        client.chat.completions.create(**ask)
    assert third.value.body["code"] in ("episode_call_limit", "episode_token_limit")
    # Timed out: 410, and the record says so.
    mesh.call(setattr, episode, "deadline", 0.0)
    with pytest.raises(openai.APIStatusError) as late:
        client.chat.completions.create(**ask)
    assert late.value.status_code == 410 and late.value.body["code"] == "episode_timed_out"
    assert mesh.call(gateway.episodes.close, episode.key).status == "timed_out"


class GatedGenerator(RouterGenerator):
    """The router's generator, held at a gate: calls stay in flight until the test opens it."""

    def __init__(self, router):
        super().__init__(router)
        self.gate = threading.Event()

    async def generate(self, prompt_ids, params, routing_key):
        await asyncio.to_thread(self.gate.wait, 60)
        return await super().generate(prompt_ids, params, routing_key)


def test_calls_past_the_in_flight_limit_get_429_and_the_sdk_retries_them(mesh):
    generator = GatedGenerator(mesh.router)
    gateway = mesh.gateway_with("agent.gateway.max_inflight_calls=1", "agent.gateway.retry_after_ms=50",
                                generator=generator)
    episodes = [mesh.call(gateway.episodes.open) for _ in range(2)]
    held = threading.Thread(target=lambda: client_of(gateway, episodes[0]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "held"}], max_tokens=2))
    held.start()
    wait_until(lambda: gateway.calls.inflight == 1, 30, "the first call in flight")
    url = f"{gateway.base_url}/chat/completions"
    refused = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                         headers={"Authorization": f"Bearer {episodes[1].key}"}, timeout=30)
    assert refused.status_code == 429 and refused.headers["retry-after-ms"] == "50"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    # The SDK waits retry-after-ms and retries; the gate opens once it has been refused once more.
    retried = threading.Thread(target=lambda: OpenAI(base_url=gateway.base_url, api_key=episodes[1].key,
                                                     max_retries=50).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "retried"}], max_tokens=2))
    retried.start()
    wait_until(lambda: gateway.calls.counts["rejected/429"] >= 2, 30, "the SDK's call refused")
    generator.gate.set()
    held.join(60)
    retried.join(60)
    records = [mesh.call(gateway.episodes.close, episode.key) for episode in episodes]
    assert [len(record.calls) for record in records] == [1, 1]


class NeverSynced(RouterGenerator):
    """A rollout whose weight sync never ends: each call is held at its gate, on an event nobody sets."""

    def __init__(self, router):
        super().__init__(router)
        self.held = threading.Event()

    async def generate(self, prompt_ids, params, routing_key):
        self.held.set()
        await asyncio.Event().wait()


def test_a_call_held_past_its_deadline_gets_a_503_to_retry_and_is_not_recorded(mesh):
    generator = NeverSynced(mesh.router)
    gateway = mesh.gateway_with("agent.gateway.call_timeout_s=0.5", "agent.gateway.retry_after_ms=1500",
                                generator=generator)
    episode = mesh.call(gateway.episodes.open)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as dropped:
        client_of(gateway, episode).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "during a sync"}], max_tokens=2)
    waited = time.monotonic() - started
    assert generator.held.is_set() and waited >= 0.5  # it waited its deadline at the gate, then was dropped
    response = dropped.value.response
    assert response.status_code == 503 and dropped.value.body["code"] == "call_timeout"
    assert (response.headers["retry-after-ms"], response.headers["retry-after"]) == ("1500", "1")
    assert gateway.calls.counts["call_timeouts"] == 1 and gateway.calls.inflight == 0
    record = mesh.call(gateway.episodes.close, episode.key)
    assert record.calls == [] and record.status == "closed"  # the episode itself did not time out


@pytest.mark.slow  # ~30 s here: 512 calls through 256 SDK clients
def test_256_concurrent_episodes_each_record_only_their_own_calls(mesh):
    gateway = mesh.gateway
    episodes = [mesh.call(gateway.episodes.open) for _ in range(256)]

    async def agent(http: httpx.AsyncClient, index: int, key: str) -> None:
        client = AsyncOpenAI(base_url=gateway.base_url, api_key=key, http_client=http, max_retries=0)
        messages = [{"role": "user", "content": f"episode {index}"}]
        for _ in range(2):
            reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=3)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]

    async def all_agents() -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=300), timeout=120) as http:
            await asyncio.gather(*(agent(http, i, e.key) for i, e in enumerate(episodes)))

    asyncio.run(all_agents())
    for index, episode in enumerate(episodes):
        record = mesh.call(gateway.episodes.close, episode.key)
        assert len(record.calls) == 2 and len(record.segments) == 1
        assert f"episode {index}<" in mesh.tokenizer.decode(record.segments[0].prompt_ids)
    assert mesh.call(len, gateway.episodes) == 0


def _gateway_traced_bytes() -> int:
    """Bytes that code of the gateway and the router allocated and still hold (tracemalloc): a leak per episode
    shows there to the byte, where the process's RSS moves with torch's and glibc's pools in this process."""
    snapshot = tracemalloc.take_snapshot().filter_traces([
        tracemalloc.Filter(True, "*/gateway/*"), tracemalloc.Filter(True, "*/rollout/router.py")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.slow  # ~60-100 s here: 1,000 one-token calls, traced
def test_a_thousand_episodes_leave_the_gateways_memory_flat(mesh):
    """A closed episode leaves nothing behind but its key, and at most closed_episodes_remembered keys are kept:
    past that many, the gateway's memory stays flat however many episodes go through. Agents come 64 at a time,
    and the call latencies are taken once per batch, as a run's step takes them."""
    remembered, batch = 100, 64
    gateway = mesh.gateway_with(f"agent.gateway.closed_episodes_remembered={remembered}")

    async def one(http: httpx.AsyncClient, key: str, index: int) -> None:
        reply = await http.post(f"{gateway.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"model": "m", "max_tokens": 1,
                                      "messages": [{"role": "user", "content": f"episode {index}"}]})
        assert reply.status_code == 200, reply.text

    def episodes(count: int, close: bool = True) -> list:
        """`count` one-call episodes, `batch` at a time; the open ones, unless closed."""
        still_open = []

        async def calls(opened) -> None:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=batch), timeout=120) as http:
                await asyncio.gather(*(one(http, e.key, i) for i, e in enumerate(opened)))

        for start in range(0, count, batch):
            opened = [mesh.call(gateway.episodes.open) for _ in range(min(batch, count - start))]
            asyncio.run(calls(opened))
            for episode in opened if close else ():
                assert len(mesh.call(gateway.episodes.close, episode.key).calls) == 1
            still_open += [] if close else opened
            mesh.call(gateway.calls.take_metrics)
            mesh.log.clear()  # the test's own log of engine requests
        return still_open

    measured = 1000 - 2 * remembered - 8
    tracemalloc.start()  # before the first episode: what it keeps is traced from its allocation on
    try:
        episodes(2 * remembered)  # past the remembered keys; the latency histogram's series made, pools warm
        gc.collect()
        before = _gateway_traced_bytes()
        held = episodes(8, close=False)  # what an episode holds while open: the footprint a leak would keep
        gc.collect()
        per_episode = (_gateway_traced_bytes() - before) / len(held)
        for episode in held:
            mesh.call(gateway.episodes.close, episode.key)
        gc.collect()
        start = _gateway_traced_bytes()
        episodes(measured)
        gc.collect()
        grown = _gateway_traced_bytes() - start
    finally:
        tracemalloc.stop()
    print(f"an open episode holds {per_episode:.0f} B; after {measured} more episodes the gateway holds {grown:+d} B")
    assert per_episode > 0
    # Flat: not even one episode in fifty leaves its footprint behind.
    assert grown < measured / 50 * per_episode, (grown, per_episode)
    assert mesh.call(len, gateway.episodes) == 0
