"""The three ways an episode's agent runs (agent.runner), each `await runner.run(task, llm) -> AgentOutcome`.

    inline      the entrypoint awaited in this (the coordinator's) event loop: no process per episode
    subprocess  `python -m rlfabric.agents.host ENTRYPOINT` per episode: the task as JSON on stdin, OPENAI_BASE_URL,
                OPENAI_API_KEY and OPENAI_MODEL in its environment, its result as JSON on stdout; with
                agent.subprocess.preload, a process forked per episode from a warm host (rlfabric.agents.warm)
    command     agent.command (any language): the same variables and stdin, its result as JSON on stdout's last line

Subprocess and command agents start through their launcher (rlfabric.agents.jail): a network that reaches the
gateway only, and as root a uid claimed per episode from agent.uid's range, the agent.* limits and private temp
dirs (rlfabric.agents.confinement). A runner raises AgentFailed for what the agent did wrong (raised, exited with an error, printed garbage); the
caller bounds the time (agent.timeout_s) and cancels, which kills a runner's process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import urllib.parse
from dataclasses import replace
from typing import Any

from rlfabric.agents.confinement import AgentJail, Limits, reachable_paths
from rlfabric.agents.entrypoint import check_entrypoint, load_entrypoint, split_entrypoint
from rlfabric.agents.jail import NO_ISOLATION
from rlfabric.agents.llm import LLM, AgentRunner
from rlfabric.agents.outcome import EXITED, GARBAGE, RAISED, AgentFailed, AgentOutcome, parse_outcome
from rlfabric.agents.warm import WarmHost
from rlfabric.core.config import ConfigError
from rlfabric.core.config.agent import AgentConfig
from rlfabric.sandbox.confine import UidClaim, claim_uid, kill_processes_of

log = logging.getLogger("rlfabric.agents")

STDERR_KEPT = 600  # characters of a failed process's stderr its failure message keeps (the end)


class InlineRunner:
    """Awaits the entrypoint in this event loop (loaded once, at the run's start). Its episodes share one
    connection pool, handed to the agent as llm.http_client: an AsyncOpenAI made per episode builds a pool of
    its own, and loading the CA bundle for it took 20-40 ms of CPU here, more than the episode's calls to a
    small model (half the coordinator's CPU in the lookup agent's run)."""

    def __init__(self, entrypoint: str):
        self.function = load_entrypoint(entrypoint)
        self.http_client = None  # made on the loop that runs the episodes

    async def run(self, task: dict[str, Any], llm: LLM) -> AgentOutcome:
        if self.http_client is None:
            self.http_client = shared_http_client()
        try:
            value = await self.function(task, replace(llm, http_client=self.http_client))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            raise AgentFailed(RAISED, f"{type(error).__name__}: {error}") from error
        return parse_outcome(value)

    async def close(self) -> None:
        if self.http_client is not None:
            await self.http_client.close_pool()
            self.http_client = None


def shared_http_client():
    """The openai SDK's own HTTP client class (the only one AsyncOpenAI takes), left open by an episode's
    `async with AsyncOpenAI(...)`, which closes its client's pool on the way out; InlineRunner.close() ends it.
    None without the openai package (an agent that does not use it)."""
    try:
        from openai import DefaultAsyncHttpxClient
    except ImportError:
        return None

    class EpisodesPool(DefaultAsyncHttpxClient):
        async def aclose(self) -> None:
            pass  # an episode's client closing: the pool outlives it

        async def close_pool(self) -> None:
            await super().aclose()

    return EpisodesPool()


class ProcessRunner:
    """Runs a program per episode: `argv`, the task as JSON on stdin, the LLM's variables in its environment;
    the last line it prints is its result as JSON. With network_isolation or a `jail`, through the launcher
    rlfabric.agents.jail; with `uid_range` (first, count; root only), each episode's process tree runs as a uid
    claimed from it, killed to the last process and its temp files deleted when the episode ends."""

    def __init__(self, argv: list[str], working_dir: str = "", network_isolation: bool = False,
                 require_network_isolation: bool = False, jail: AgentJail | None = None,
                 uid_range: tuple[int, int] | None = None):
        self.argv = argv
        self.working_dir = working_dir or None
        self.network_isolation = network_isolation
        self.require = ["--require"] if require_network_isolation else []
        self.jail = jail
        self.uid_range = uid_range

    async def close(self) -> None:
        pass  # a process per episode: nothing outlives one

    def command_line(self, llm: LLM, uid: int | None = None) -> list[str]:
        """argv, run through rlfabric.agents.jail (a network that reaches the gateway only, the jail as `uid`)
        if asked."""
        if not self.network_isolation and self.jail is None:
            return self.argv
        return [sys.executable, "-m", "rlfabric.agents.jail", *self.require, self.gateway(llm),
                self.jail_for(uid).to_json(), "--", *self.argv]

    def gateway(self, llm: LLM) -> str:
        """The jail's HOST:PORT to relay to, or - (no network isolation)."""
        if not self.network_isolation:
            return "-"
        url = urllib.parse.urlsplit(llm.base_url)
        return f"{url.hostname}:{url.port or 80}"

    def jail_for(self, uid: int | None) -> AgentJail:
        return replace(self.jail, uid=uid) if self.jail is not None else AgentJail(private_tmp=False)

    async def run(self, task: dict[str, Any], llm: LLM) -> AgentOutcome:
        claim = claim_uid(*self.uid_range) if self.uid_range is not None else None
        try:
            return await self._run(task, llm, claim.uid if claim is not None else None)
        finally:
            if claim is not None:  # what escaped the launcher (setsid, double forks), then its files
                await asyncio.shield(asyncio.to_thread(_end_claim, claim))

    async def _run(self, task: dict[str, Any], llm: LLM, uid: int | None) -> AgentOutcome:
        process = await asyncio.create_subprocess_exec(
            *self.command_line(llm, uid), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=self.working_dir, env={**os.environ, **llm.env()})
        try:
            stdout, stderr = await process.communicate(json.dumps(task).encode())
        except BaseException:  # cancelled (agent.timeout_s): the process goes with the episode
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise
        return self.outcome(process.returncode, stdout, stderr)

    def outcome(self, status: int, stdout: bytes, stderr: bytes) -> AgentOutcome:
        """What an episode's process gave: its result, or AgentFailed for its exit status or its garbage."""
        if status == NO_ISOLATION and self.network_isolation:
            raise AgentFailed(EXITED, stderr.decode(errors="replace")[-STDERR_KEPT:].strip())
        if status != 0:
            tail = stderr.decode(errors="replace")[-STDERR_KEPT:].strip()
            raise AgentFailed(EXITED, f"{self.argv[0]} exited with status {status}: {tail}")
        return parse_outcome(last_json_line(stdout.decode(errors="replace")))


class WarmProcessRunner(ProcessRunner):
    """ProcessRunner's episodes, forked from a warm host of the entrypoint (rlfabric.agents.forkserver) rather
    than started as `python -m rlfabric.agents.host` each; `argv` (that command) is what runs where the host
    cannot fork safely (its imports left threads running)."""

    def __init__(self, entrypoint: str, argv: list[str], **options: Any):
        super().__init__(argv, **options)
        self.entrypoint = entrypoint
        self.host: WarmHost | None = None
        self.cold = False  # the host could not fork safely: a process per episode
        self._starting: asyncio.Lock | None = None

    async def _warm_host(self) -> WarmHost | None:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.cold or (self.host is not None and self.host.alive):
                return self.host
            if self.host is not None:
                await self.host.close()
            self.host = await WarmHost.start(self.entrypoint, self.working_dir)
            if self.host.ready.result()["threads"] > 1:
                log.warning(
                    "the warm agent host's imports left %d threads running, which a fork does not keep: "
                    "subprocess agents start a process per episode",
                    self.host.ready.result()["threads"],
                )
                await self.host.close()
                self.host, self.cold = None, True
            return self.host

    async def _run(self, task: dict[str, Any], llm: LLM, uid: int | None) -> AgentOutcome:
        host = await self._warm_host()
        if host is None:
            return await super()._run(task, llm, uid)
        request = {
            "env": llm.env(),
            "jail": self.jail_for(uid).to_json(),
            "gateway": self.gateway(llm),
            "require": bool(self.require),
        }
        status, stdout, stderr = await host.run(request, json.dumps(task).encode())
        return self.outcome(status, stdout, stderr)

    async def close(self) -> None:
        if self.host is not None:
            await self.host.close()
            self.host = None


def _end_claim(claim: UidClaim) -> None:
    kill_processes_of(claim.uid)
    claim.release()


def last_json_line(stdout: str) -> Any:
    """The JSON value on the last non-empty line of a program's output; AgentFailed("garbage") if it is not JSON."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise AgentFailed(GARBAGE, "the agent printed nothing: print its result as JSON on the last line")
    try:
        return json.loads(lines[-1])
    except ValueError:
        shown = lines[-1] if len(lines[-1]) <= 120 else lines[-1][:117] + "..."
        raise AgentFailed(GARBAGE, f"the agent's last line is not JSON: {shown!r}") from None


def runner_of(settings: AgentConfig) -> AgentRunner:
    """agent.runner's runner; ConfigError (naming the key) when its entrypoint or command cannot run."""
    if settings.runner == "inline":
        return InlineRunner(settings.entrypoint)
    if settings.runner == "service":
        # (gRPC stubs: only runs that ask a host need them)
        from rlfabric.agents.service import ServiceRunner, read_agent_token

        return ServiceRunner(settings.address, settings.timeout_s, read_agent_token(settings))
    entrypoint_dir = ""
    if settings.runner == "subprocess":
        check_entrypoint(settings.entrypoint)
        argv = [sys.executable, "-m", "rlfabric.agents.host", settings.entrypoint]
        where, _ = split_entrypoint(settings.entrypoint)
        entrypoint_dir = os.path.dirname(os.path.abspath(where)) if where.endswith(".py") else ""
    else:
        argv = list(settings.command)
    uid_range = None
    if os.geteuid() == 0:
        uid_range = (settings.uid, settings.uid_count)
    elif settings.require_sandbox_uid:
        raise ConfigError(f"agent.require_sandbox_uid is set, but the service runs as uid {os.getuid()}, not root: "
                          f"{settings.runner} agents cannot have a uid of their own")
    else:
        _warn_once(f"the service does not run as root, so {settings.runner} agents run as its uid {os.getuid()}: "
                   "they can read every file the service can and signal its processes; no RLIMIT_NPROC either "
                   "(agent.require_sandbox_uid makes this an error)")
    limits = Limits(settings.memory_limit_mb, settings.max_processes, settings.max_open_files, settings.max_file_mb,
                    settings.cpu_limit_s)
    working_dir = os.path.abspath(settings.working_dir) if settings.working_dir else os.getcwd()
    jail = AgentJail(gid=settings.gid, private_tmp=settings.private_tmp, limits=limits,
                     reachable=reachable_paths(argv, entrypoint_dir, working_dir))
    options = dict(working_dir=settings.working_dir, network_isolation=settings.network_isolation,
                   require_network_isolation=settings.require_network_isolation, jail=jail, uid_range=uid_range)
    if settings.runner == "subprocess" and settings.subprocess.preload:
        return WarmProcessRunner(settings.entrypoint, argv, **options)
    return ProcessRunner(argv, **options)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)
