"""The subprocess runner's program: one episode of an entrypoint in a process of its own.

    python -m rlfabric.agents.host path/to/agent.py:run  < task.json

The task comes as JSON on stdin, the model from OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL. Whatever the
agent prints goes to stderr; stdout carries only its result, as one line of JSON. A failure exits non-zero with
the error on stderr. Its confinement (uid, limits, private temp dirs, network) is made before it starts, by its
launcher (rlfabric.agents.jail).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

from rlfabric.agents.entrypoint import load_entrypoint
from rlfabric.agents.llm import LLM


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rlfabric.agents.host ENTRYPOINT < task.json", file=sys.stderr)
        return 2
    return run_episode(argv[0])


def run_episode(entrypoint: str) -> int:
    """One episode in this process: the task from stdin, the result as JSON on stdout; the exit status. Also the
    warm host's forked child's, after it confined itself (rlfabric.agents.forkserver)."""
    task = json.load(sys.stdin)
    llm = LLM(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ.get("OPENAI_MODEL", ""))
    with contextlib.redirect_stdout(sys.stderr):  # the agent's prints must not pass for its result
        run = load_entrypoint(entrypoint)
        result = asyncio.run(run(task, llm))
    try:
        line = json.dumps(result)
    except (TypeError, ValueError) as error:
        print(f"the agent returned a {type(result).__name__} that is not JSON: {error}", file=sys.stderr)
        return 3
    sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
