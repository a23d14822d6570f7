"""The python environment: a tool that runs the model's code confined (rlfabric.env.python_runner,
the reward sandbox's confinement) and answers with what it printed.

Each call is a fresh interpreter, killed with every process it started when it runs past
env.python.timeout_s or prints more than env.python.max_output_bytes (the output then ends with a
note saying so), or when all its processes together hold more than env.python.memory_limit_mb (the
model reads why). Start-up costs one interpreter (~0.1 s). Nothing is kept between calls: each runs
as a uid of its own (as root; env.python.sandbox.uid, uid_count), with its own empty /tmp, /var/tmp
and /dev/shm (a mount namespace; where none can be made, the host's, cleared of the call's files
after it) and a fresh working directory; it cannot signal another call or the reward scorer.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from rlfabric.env.environment import Tool, ToolEnvironment, ToolError, ToolTimeout
from rlfabric.env.items import Task, ToolSpec
from rlfabric.sandbox.confine import user_variables, worker_environment
from rlfabric.sandbox.process_tree import end_supervisor

if TYPE_CHECKING:
    from rlfabric.core.config import EnvConfig, PythonToolConfig

log = logging.getLogger("rlfabric.env")

PYTHON_SPEC = ToolSpec(
    name="python",
    description="Runs Python 3 code and returns what it prints (stdout and stderr). No network, no state "
                "kept between calls.",
    parameters={"type": "object", "properties": {"code": {"type": "string", "description": "The code."}},
                "required": ["code"]},
)
_warned: set[str] = set()  # confinement warnings logged once per process
# How long the supervisor may take to clean up (release the uid, delete its temp files) once the code is killed.
_SUPERVISOR_EXIT_S = 5.0


class PythonEnvironment(ToolEnvironment):
    """One tool, python(code); the final answer scores as the task's ground truth ("#### ANSWER")."""

    def __init__(self, task: Task, config: EnvConfig):
        super().__init__(task, [Tool(PYTHON_SPEC, self.python)])
        self.python_config = config.python

    def python(self, code: str) -> str:
        return run_python(code, self.python_config)


def run_python(code: str, config: PythonToolConfig) -> str:
    """What `code` prints, run confined; ToolError when it fails (its output in the message),
    ToolTimeout when it runs past config.timeout_s."""
    sandbox = config.sandbox.model_dump()
    sandbox["variables"] = user_variables(config.sandbox.env, config.sandbox.env_passthrough)
    settings = {"sandbox": sandbox, "memory_limit_mb": config.memory_limit_mb, "timeout_s": config.timeout_s}
    process = subprocess.Popen(
        [sys.executable, "-m", "rlfabric.env.python_runner"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, env=worker_environment(),
    )
    try:
        process.stdin.write(json.dumps(settings).encode() + b"\n" + code.encode())
        process.stdin.close()
        output, ending = _read_output(process, config.max_output_bytes, time.monotonic() + config.timeout_s)
    except BrokenPipeError:  # the runner died before reading the code
        output, ending = b"", ENDED
    finally:
        # The code's processes first: the supervisor then releases the call's uid (its temp files
        # deleted) and exits.
        end_supervisor(process, _SUPERVISOR_EXIT_S)
        reports = _reports(process.stderr.read(1 << 16))
        process.stderr.close()
        process.stdout.close()
    text = output[: config.max_output_bytes].decode(errors="replace")
    exceeded = [report["memory_exceeded"] for report in reports if "memory_exceeded" in report]
    if exceeded:
        raise ToolError(f"the code was killed: {exceeded[0]}; its output so far:\n{text}")
    refused = [report["sandbox_error"] for report in reports if "sandbox_error" in report]
    if refused:
        raise ToolError(f"the code did not run: {refused[0]}")
    if ending == CUT_OFF:
        return text + f"\n[output cut off at {config.max_output_bytes} bytes]"
    if ending == TIMED_OUT:
        raise ToolTimeout(f"the code ran past {config.timeout_s:g} s; its output so far:\n{text}")
    if process.returncode != 0:
        raise ToolError(f"the code exited with status {process.returncode}:\n{text}")
    return text


ENDED, TIMED_OUT, CUT_OFF = "ended", "timed out", "cut off"


def _read_output(process: subprocess.Popen, max_bytes: int, deadline: float) -> tuple[bytes, str]:
    """(stdout, how reading ended): the runner ENDED, or it TIMED_OUT, or its output was CUT_OFF past max_bytes."""
    chunks: list[bytes] = []
    size = 0
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while size <= max_bytes:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(timeout=left):
                return b"".join(chunks), TIMED_OUT
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if not chunk:  # every holder of the pipe is gone: the supervisor is exiting
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return b"".join(chunks), TIMED_OUT
                return b"".join(chunks), ENDED
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks), CUT_OFF


def _reports(stderr: bytes) -> list[dict]:
    """The JSON lines the supervisor and the runner wrote to stderr; their warnings logged once per process."""
    reports = []
    for line in stderr.splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if not isinstance(report, dict):
            continue
        reports.append(report)
        for warning in report.get("warnings", []) + ([report["sandbox_error"]] if "sandbox_error" in report else []):
            if warning not in _warned:
                _warned.add(warning)
                log.warning("python tool sandbox: %s", warning)
    return reports
