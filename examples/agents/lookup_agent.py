"""A tool-using agent written against the plain openai SDK, with no rlfabric import: rlfabric trains it as it is.

The lookup task (rlfabric.env.lookup): "Look up key q and answer with #### and the number." The number is only
in the agent's lookup tool, whose table comes with the task. The agent runs its own loop: it asks the model,
runs the tool calls the model makes, sends their results back, and returns the model's final answer, which
rlfabric's reward service scores ("#### 7" against the row's ground truth, which the agent never sees).

    rlfabric train examples/agents/lookup.yaml                  # agent.runner subprocess: a process per episode
    rlfabric train examples/agents/lookup.yaml agent.runner=inline             # in the coordinator's event loop
    rlfabric train examples/agents/lookup.yaml agent.runner=command 'agent.command=[python,examples/agents/lookup_agent.py]'

AsyncOpenAI() reads OPENAI_BASE_URL and OPENAI_API_KEY, which rlfabric sets per episode (the key is the
episode's: the gateway records every call of it as the token ids the model consumed and sampled). Inline, the
agent gets them in `llm`, with one HTTP connection pool for all episodes (`llm.http_client`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from openai import AsyncOpenAI

MAX_TURNS = 3
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The number stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "The key."}},
                   "required": ["key"]}}}]


def lookup_table(task: dict) -> dict[str, str]:
    """The tool's data: the row's table (public; the answer's ground truth is not in the task)."""
    table = task["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["table"]
    return {key: str(value) for key, value in table.items() if value is not None}


def run_tool(table: dict[str, str], call) -> str:
    try:
        key = json.loads(call.function.arguments).get("key", "")
    except (ValueError, AttributeError):
        return "error: the arguments are not a JSON object"
    return table.get(str(key), f"error: no key {key!r}")


async def run(task: dict, llm=None) -> dict:
    """One episode: the model's final answer, for the reward service to score."""
    # rlfabric's subprocess and command runners set OPENAI_BASE_URL and OPENAI_API_KEY (the episode's key), so a
    # plain AsyncOpenAI() works there; the inline runner runs many episodes in one process and hands them in llm.
    model = llm.model if llm else os.environ.get("OPENAI_MODEL", "policy")
    table = lookup_table(task)
    messages = list(task["messages"])
    tool_calls = 0
    # The inline runner's llm.http_client is one connection pool for all episodes (None elsewhere: the SDK's own).
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=llm.http_client) if llm \
            else AsyncOpenAI() as client:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            if not message.tool_calls:
                return {"answer": message.content or "", "metrics": {"tool_calls": tool_calls}}
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                tool_calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(table, call)})
    return {"answer": "", "metrics": {"tool_calls": tool_calls}}


if __name__ == "__main__":  # agent.runner command: the task on stdin, the result as JSON on stdout
    print(json.dumps(asyncio.run(run(json.load(sys.stdin), None))))
