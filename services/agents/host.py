"""The subprocess runner's program: one episode of an entrypoint in a process of its own.

    python -m rlfabric.agents.host [--private-tmp] path/to/agent.py:run  < task.json

The task comes as JSON on stdin, the model from OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL. Whatever the
agent prints goes to stderr; stdout carries only its result, as one line of JSON. A failure exits non-zero with
the error on stderr.

--private-tmp (agent.private_tmp): once the agent's code is imported, the process moves into a mount namespace
of its own with empty tmpfs on /tmp, /var/tmp and /dev/shm (rlfabric.sandbox.confine), so what the agent
writes there is its own and goes with the process. Where the kernel refuses, stderr says so and the host's
stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

from rlfabric.agents.entrypoint import load_entrypoint
from rlfabric.agents.llm import LLM
from rlfabric.sandbox.confine import enter_namespaces

# The sandbox settings enter_namespaces reads: temp dirs of its own; the network stays (it must reach the gateway).
PRIVATE_TMP = {"allow_network": True, "private_tmp": True, "require_network_isolation": False}


def main(argv: list[str]) -> int:
    private_tmp = argv[:1] == ["--private-tmp"]
    argv = argv[1:] if private_tmp else argv
    if len(argv) != 1:
        print("usage: python -m rlfabric.agents.host [--private-tmp] ENTRYPOINT < task.json", file=sys.stderr)
        return 2
    task = json.load(sys.stdin)
    llm = LLM(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ.get("OPENAI_MODEL", ""))
    with contextlib.redirect_stdout(sys.stderr):  # the agent's prints must not pass for its result
        run = load_entrypoint(argv[0])  # before the private /tmp: the agent's file may live in the host's
        if private_tmp:
            for warning in enter_namespaces(PRIVATE_TMP, None, os.getcwd(), as_root=os.getuid() == 0):
                print(f"rlfabric agent host: {warning}", file=sys.stderr)
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
