"""The lookup environment: a multi-turn toy task whose answer only a tool call gives.

Each row asks for the number stored under a key; the table is in the row's extra_info (VeRL's
tools_kwargs: {"tools_kwargs": {"lookup": {"create_kwargs": {"table": {"k": "7"}}}}}), which the model
never sees. The model has to call lookup(key), read the number, and answer "#### NUMBER": reward 1,
else 0; a guess is right one time in ten. The shortest good episode is two turns:

    user:       Look up key q and answer with #### and the number.
    assistant:  <tool_call>{"name": "lookup", "arguments": {"key": "q"}}</tool_call>
    tool:       7
    assistant:  #### 7

A model learns this by RL once it can write the call (a Hermes tool call is ~60 characters, which no
random policy of the tiny model hits): its warm start has to show the format; RL then learns to use it.
"""

from __future__ import annotations

import random
import string
from typing import TYPE_CHECKING, Any

from rlfabric.core.errors import InvalidArgument
from rlfabric.env.environment import Tool, ToolEnvironment, ToolError
from rlfabric.env.items import Task, ToolSpec

if TYPE_CHECKING:
    from rlfabric.core.config import EnvConfig

DATA_SOURCE = "rlfabric/lookup"
QUESTION = "Look up key {key} and answer with #### and the number."

LOOKUP_SPEC = ToolSpec(
    name="lookup",
    description="The number stored under a key.",
    parameters={"type": "object", "properties": {"key": {"type": "string", "description": "The key."}},
                "required": ["key"]},
)


class LookupEnvironment(ToolEnvironment):
    """One tool, lookup(key), over the row's table; the final answer scores against the ground truth."""

    def __init__(self, task: Task, config: EnvConfig):
        table = task.create_kwargs("lookup").get("table", {})
        if not isinstance(table, dict):
            raise InvalidArgument("extra_info.tools_kwargs.lookup.create_kwargs.table must be an object")
        # parquet stores the tables of all rows as one struct: another row's keys come back as null
        self.table = {str(key): str(value) for key, value in table.items() if value is not None}
        super().__init__(task, [Tool(LOOKUP_SPEC, self.lookup)])

    def lookup(self, key: str) -> str:
        if key not in self.table:
            raise ToolError(f"no key {key!r}")
        return self.table[key]


def make_row(rng: random.Random) -> dict[str, Any]:
    """One data row (VeRL's columns): a key, its random digit in extra_info's table, the digit as ground truth."""
    key = rng.choice(string.ascii_lowercase)
    value = str(rng.randint(0, 9))
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION.format(key=key)}],
        "reward_model": {"style": "rule", "ground_truth": value},
        "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"table": {key: value}}}}},
    }
