"""A small local verifiers 0.4 task set (no hub, no download): "3+4=", scored by verifiers' own reward hooks
(the sum right: 1; the share of digits in the reply: up to DIGITS_WEIGHT more). Its module name is its taskset
id (verifiers imports a taskset by id): put this directory on sys.path (data.verifiers.path) and name it
`rlfabric_sums`.

The module also exports its harness, which verifiers takes as the task set's default: verifiers' own chat
program (the `null` harness's), run by this interpreter. The built-in harness installs that program's
dependencies with uv on first use, which needs an index; the verifiers venv already holds them (openai, mcp,
httpx, tenacity), so an episode needs no network beyond the model's endpoint.
"""

from __future__ import annotations

import random
import sys

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

SIZE = 64
SEED = 0
SYSTEM_PROMPT = "Answer with the number only."
DIGITS_WEIGHT = 0.25

__all__ = ["SumsTaskset", "LocalChatHarness"]


class SumData(vf.TaskData):
    answer: str
    """The sum, as digits: verifiers' reward reads it; rlfabric's rows never carry it."""


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        """1.0 when the final reply, stripped, is the sum."""
        return 1.0 if trace.last_reply == task.answer else 0.0

    @vf.reward(weight=DIGITS_WEIGHT)
    async def digits(self, task: SumData, trace: vf.Trace) -> float:
        """The share of the reply's characters that are digits: partial credit for answering with a number."""
        reply = trace.last_reply
        return sum(char.isdigit() for char in reply) / len(reply) if reply else 0.0


class SumsTaskset(vf.Taskset[SumTask]):
    def load(self):
        rng = random.Random(SEED)
        for index in range(SIZE):
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            data = SumData(
                id=f"sum-{index}", prompt=f"{a}+{b}=", system_prompt=SYSTEM_PROMPT, answer=str(a + b)
            )
            yield SumTask(data, self.config.task)


class _NoUv:
    """The episode's runtime, but a PEP 723 script runs with this interpreter instead of a uv environment."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script, env=None, *, activate=True):
        data = script.encode() if isinstance(script, str) else script
        await self._runtime.write("vf-chat-program.py", data)  # in the runtime's working directory, its cwd
        return [sys.executable, "vf-chat-program.py"]


class LocalChatHarness(NullHarness):
    """verifiers' `null` chat harness, its program run by this interpreter (see the module docstring)."""

    async def setup(self, runtime) -> None:
        pass  # nothing to install

    async def launch(self, ctx, trace, runtime, *args, **kwargs):
        return await super().launch(ctx, trace, _NoUv(runtime), *args, **kwargs)
