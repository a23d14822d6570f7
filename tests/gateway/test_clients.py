"""`stream=True` and `False`, through the openai SDK and LangChain's `ChatOpenAI.bind_tools`, with one episode
seed: the same recorded ids, and the same final messages as each client assembles them (issue 47's acceptance
row). A tool agent on the lookup task, over the lookup warm start (a tiny model that writes hermes calls) on
the hf engine behind the gateway; the seed is one whose first reply calls the tool, so both turns of the
agent (the call, the answer after the tool's reply) and the streamed tool-call deltas are exercised.

LangChain (`langchain-openai`, the dev extra) is imported where installed; its test skips otherwise. Slow only
on a machine's first use, which builds the lookup warm start into the model cache (over a minute); ~15 s after."""

from __future__ import annotations

import asyncio
import functools
import json
import operator

import pytest
from openai import AsyncOpenAI, OpenAI

from rlfabric.env.lookup import QUESTION
from rlfabric.quickstart.cached import cached_lookup_model
from rlfabric.quickstart.lookup_warm_start import LEARNER
from tests.gateway.helpers import GatewayMesh

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The number stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
TABLE = {"q": "7"}
MAX_TOKENS = 80  # a hermes call to lookup is ~67 tokens of the character-level tokenizer
SEEDS = 48  # episode seeds tried for a first reply that calls the tool (the warm start calls in ~10% of samples)


def run_tool(arguments: str) -> str:
    try:
        return TABLE.get(str(json.loads(arguments).get("key")), "error: no such key")
    except (ValueError, AttributeError):
        return "error: the arguments are not a JSON object"


@pytest.fixture(scope="module")
def mesh():
    mesh = GatewayMesh(cached_lookup_model(**LEARNER), f"data.max_response_length={MAX_TOKENS}")
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def calling_seed(mesh) -> int:
    """The first episode seed whose first reply is a call to the tool."""
    gateway = mesh.gateway

    async def first_replies():  # on the mesh's loop, as the gateway's state is
        episodes = [gateway.episodes.open(seed) for seed in range(SEEDS)]
        async with AsyncOpenAI(base_url=gateway.base_url, api_key="-", max_retries=0) as client:
            replies = await asyncio.gather(*(client.with_options(api_key=episode.key).chat.completions.create(
                model="m", messages=[{"role": "user", "content": QUESTION.format(key="q")}], tools=TOOLS,
                max_tokens=MAX_TOKENS) for episode in episodes))
        for episode in episodes:
            gateway.episodes.close(episode.key)
        return replies

    replies = asyncio.run_coroutine_threadsafe(first_replies(), mesh.loop).result(timeout=300)
    calling = [seed for seed, reply in enumerate(replies) if reply.choices[0].message.tool_calls]
    assert calling, f"none of {SEEDS} seeds' first replies called the tool"
    return calling[0]


def openai_agent(client: OpenAI, stream: bool) -> list[dict]:
    """The lookup agent on the openai SDK: each assistant message as the SDK assembles it (its stream helper
    when streaming), the tool's reply after a call."""
    messages: list[dict] = [{"role": "user", "content": QUESTION.format(key="q")}]
    replies = []
    for _ in range(2):
        ask = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": MAX_TOKENS}
        if stream:
            with client.chat.completions.stream(**ask) as events:
                completion = events.get_final_completion()
        else:
            completion = client.chat.completions.create(**ask)
        message = completion.choices[0].message
        replies.append({"content": message.content or "", "finish_reason": completion.choices[0].finish_reason,
                        "tool_calls": [(c.id, c.function.name, json.loads(c.function.arguments))
                                       for c in message.tool_calls or ()]})
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            break
        messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(c.function.arguments)}
                     for c in message.tool_calls]
    return replies


def langchain_agent(chat_model, stream: bool) -> list[dict]:
    """The lookup agent on LangChain: ChatOpenAI.bind_tools, each AIMessage as invoke() returns it or as the
    streamed chunks add up."""
    from langchain_core.messages import HumanMessage, ToolMessage

    model = chat_model.bind_tools(TOOLS)
    messages: list = [HumanMessage(QUESTION.format(key="q"))]
    replies = []
    for _ in range(2):
        message = functools.reduce(operator.add, model.stream(messages)) if stream else model.invoke(messages)
        replies.append({"content": message.content or "",
                        "finish_reason": message.response_metadata.get("finish_reason"),
                        "tool_calls": [(c["id"], c["name"], c["args"]) for c in message.tool_calls]})
        messages.append(message)
        if not message.tool_calls:
            break
        messages += [ToolMessage(run_tool(json.dumps(c["args"])), tool_call_id=c["id"]) for c in message.tool_calls]
    return replies


def recorded(mesh, seed: int, agent) -> tuple[list[dict], list[tuple]]:
    """What the agent assembled, and its episode's record: each call's parent, prompt ids, sampled ids and
    log-probs."""
    gateway = mesh.gateway
    episode = mesh.call(gateway.episodes.open, seed)
    replies = agent(episode.key)
    record = mesh.call(gateway.episodes.close, episode.key)
    return replies, [(c.parent, c.prompt_ids, c.token_ids, c.logprobs) for c in record.calls]


def check_tool_agent_run(replies: list[dict], calls: list[tuple]) -> None:
    """The tool fired: a call to lookup, then an answer after its reply, in one conversation (one segment)."""
    assert [reply["finish_reason"] for reply in replies] == ["tool_calls", "stop"]
    assert [name for _, name, _ in replies[0]["tool_calls"]] == ["lookup"] and replies[1]["tool_calls"] == []
    assert [parent for parent, *_ in calls] == [None, 0]


def test_openai_sdk_streamed_and_plain_record_the_same_ids_and_assemble_the_same_messages(mesh, calling_seed):
    runs = {stream: recorded(mesh, calling_seed, lambda key, stream=stream: openai_agent(
        OpenAI(base_url=mesh.gateway.base_url, api_key=key, max_retries=0), stream)) for stream in (False, True)}
    check_tool_agent_run(*runs[False])
    assert runs[True] == runs[False]


def test_langchain_bind_tools_streamed_and_plain_record_the_same_ids_as_the_openai_sdk(mesh, calling_seed):
    import langchain_openai  # the dev extra's: missing, the test fails rather than skips

    def agent(stream: bool):
        return lambda key: langchain_agent(langchain_openai.ChatOpenAI(
            model="m", base_url=mesh.gateway.base_url, api_key=key, max_retries=0, max_tokens=MAX_TOKENS), stream)

    runs = {stream: recorded(mesh, calling_seed, agent(stream)) for stream in (False, True)}
    check_tool_agent_run(*runs[False])
    assert runs[True] == runs[False]
    sdk_replies, sdk_calls = recorded(mesh, calling_seed, lambda key: openai_agent(
        OpenAI(base_url=mesh.gateway.base_url, api_key=key, max_retries=0), stream=False))
    assert runs[False] == (sdk_replies, sdk_calls)  # the same calls whichever client made them


def test_inline_episodes_share_one_connection_pool_that_outlives_each_episodes_client(mesh, tmp_path):
    """The inline runner hands every episode one pool (llm.http_client): an agent's `async with AsyncOpenAI(...)`
    closes its client at the episode's end, and the next episode's calls still go through; the runner's close()
    ends the pool. Without it each episode built a pool and loaded the CA bundle (rlfabric.agents.runners)."""
    from rlfabric.agents.llm import LLM
    from rlfabric.agents.runners import InlineRunner

    (tmp_path / "agent.py").write_text(
        "from openai import AsyncOpenAI\n"
        "async def run(task, llm):\n"
        "    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=llm.http_client,\n"
        "                           max_retries=0) as client:\n"
        "        reply = await client.chat.completions.create(model=llm.model, max_tokens=4,\n"
        "                                                     messages=[{'role': 'user', 'content': 'hi'}])\n"
        "    return {'answer': reply.choices[0].message.content or '', 'metrics': {'pool': id(llm.http_client)}}\n")
    runner = InlineRunner(f"{tmp_path}/agent.py:run")
    gateway = mesh.gateway

    async def episodes():  # on the mesh's loop, as the gateway's state is
        outcomes = []
        for seed in range(3):
            episode = gateway.episodes.open(seed)
            outcomes.append(await runner.run({}, LLM(gateway.base_url, episode.key, "policy")))
            assert len(gateway.episodes.close(episode.key).calls) == 1
        pool = runner.http_client
        await runner.close()
        return outcomes, pool

    outcomes, pool = mesh.run(episodes())
    assert len({outcome.metrics["pool"] for outcome in outcomes}) == 1  # one pool for the three episodes
    assert pool.is_closed and runner.http_client is None


def test_the_node_agent_records_what_the_python_agent_records_on_one_seed(mesh):
    """examples/agents/node/lookup_agent.mjs (the openai npm package) under the command runner, and
    examples/agents/lookup_agent.py inline, on an episode seed whose run calls the tool: the same recorded calls
    (parents, prompt ids, sampled ids, log-probs) and the same outcome."""
    from pathlib import Path

    from rlfabric.agents.llm import LLM
    from rlfabric.agents.runners import InlineRunner, ProcessRunner
    from tests.agents.node import AGENT, NO_NODE, NODE, install_node_agent

    assert NODE is not None, NO_NODE
    install_node_agent()
    python = InlineRunner(f"{Path(__file__).parents[2] / 'examples' / 'agents' / 'lookup_agent.py'}:run")
    node = ProcessRunner([NODE, str(AGENT)])
    task = {"messages": [{"role": "user", "content": QUESTION.format(key="q")}],
            "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"table": TABLE}}}}}
    gateway = mesh.gateway

    async def episode(runner, seed: int):
        opened = gateway.episodes.open(seed)
        try:
            outcome = await runner.run(task, LLM(gateway.base_url, opened.key, "policy"))
        finally:
            record = gateway.episodes.close(opened.key)
        return outcome, [(c.parent, c.prompt_ids, c.token_ids, c.logprobs) for c in record.calls]

    async def scenario():  # on the mesh's loop, as the gateway's state is
        runs = await asyncio.gather(*(episode(python, seed) for seed in range(SEEDS)))
        seed = next((seed for seed, (outcome, _) in enumerate(runs) if outcome.metrics["tool_calls"] >= 1), None)
        assert seed is not None, f"none of {SEEDS} seeds' episodes called the tool"
        # Each alone on the engine: a batch of another composition computes the same ids' log-probs in another order.
        alone = await episode(python, seed)
        await python.close()
        return alone, await episode(node, seed)

    (python_outcome, python_calls), (node_outcome, node_calls) = mesh.run(scenario(), timeout=300)
    assert [parent for parent, *_ in python_calls][:2] == [None, 0]  # the tool's reply extended the first call
    assert node_calls == python_calls and node_outcome == python_outcome
