"""EnvEngine: what the environment service runs behind its servicer, a table of sessions.

A session is one environment object (made by its registered factory for the task) plus its
bookkeeping. Every call into an environment runs on a thread under env.step_timeout_s, so a slow
environment never stalls the others; a call past it is DeadlineExceeded and closes its session (the
thread cannot be stopped: it ends when the environment returns, and its answer is dropped). A
session with no call for env.session_idle_timeout_s is closed by a background task; a later call
naming it gets NotFound saying so. Limits: env.max_sessions open at once, env.max_action_bytes and
env.max_tool_calls_per_step per Step, env.max_steps_per_session; an environment's answer must keep
the contract (items.check_step_result), else InvalidArgument and the session is closed.
Calls into environments run on env.threads threads of the engine's own (not the event loop's default
pool, which a few python-tool calls would fill), so that many sessions step at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from rlfabric.core.config import ConfigError, EnvConfig
from rlfabric.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RlfabricError,
    Unavailable,
)
from rlfabric.core.metrics import service_counter, service_gauge
from rlfabric.env.environment import Environment, environment_factory, registered_environments
from rlfabric.env.items import (
    STEP_STATUSES,
    Action,
    Session,
    StepResult,
    Task,
    ToolSpec,
    check_observation,
    check_step_result,
)

log = logging.getLogger("rlfabric.env")

REMEMBERED_CLOSED = 10_000  # ids of sessions closed by the service, so a late call learns why


@dataclass
class EnvStatus:
    """What GetStatus reports."""

    environments: list[str]
    """Registered environment names."""
    sessions_open: int
    sessions_started: int
    sessions_expired: int
    """Closed because they idled past env.session_idle_timeout_s."""
    steps: int


@dataclass
class _OpenSession:
    environment: Environment
    name: str
    """The environment's registered name."""
    last_used: float
    steps: int = 0
    done: bool = False
    busy: bool = False
    """A call into the environment is running."""


@dataclass
class _Counters:
    sessions_started: int = 0
    sessions_expired: int = 0
    steps: int = 0
    closed_why: OrderedDict[str, str] = field(default_factory=OrderedDict)
    """session id -> why the service closed it (the last REMEMBERED_CLOSED)."""


class EnvEngine:
    """Sessions of the registered environments; start() imports env.environment_modules and starts the
    idle-session reaper."""

    def __init__(self, config: EnvConfig, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.sessions: dict[str, _OpenSession] = {}
        self.counters = _Counters()
        self._starting = 0  # Resets past the session limit check, not in self.sessions yet
        self._reaper: asyncio.Task | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._started = False
        registry = registry if registry is not None else CollectorRegistry()
        self._sessions_total = service_counter(registry, "rlfabric_env_sessions_total",
                                               "Sessions started by the environment service.")
        self._expired_total = service_counter(registry, "rlfabric_env_sessions_expired_total",
                                              "Sessions closed because they idled past the timeout.")
        self._steps_total = service_counter(registry, "rlfabric_env_steps_total",
                                            "Steps taken, by how their tool calls went.", ("status",))
        for status in STEP_STATUSES:  # export 0 from the start, so rate() works from the first one
            self._steps_total.labels(status=status)
        self._open = service_gauge(registry, "rlfabric_env_sessions_open", "Sessions open now.")
        self._open.set_function(lambda: len(self.sessions))

    # --- lifecycle ---

    async def start(self) -> None:
        """Import the environment modules (their register_environment calls run now), check env.name."""
        for module in self.config.environment_modules:
            importlib.import_module(module)
        if self.config.name not in registered_environments():
            raise ConfigError(f"env.name: no environment {self.config.name!r}; registered: "
                              f"{', '.join(registered_environments())}")
        self._threads = ThreadPoolExecutor(self.config.threads, thread_name_prefix="rlfabric-env")
        self._reaper = asyncio.create_task(self._close_idle_sessions_forever())
        self._started = True

    async def stop(self) -> None:
        """Stop the reaper and close every session."""
        self._started = False
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for session_id in list(self.sessions):
            await self._drop(session_id, "the service stopped")
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)  # a hung environment call is left behind

    # --- the calls ---

    async def reset(self, task: Task) -> Session:
        """A new session on `task`: its id, first observation and tools."""
        self._check_started()
        if len(self.sessions) + self._starting >= self.config.max_sessions:
            raise ResourceExhausted(f"{self.config.max_sessions} sessions are open, the limit "
                                    "(env.max_sessions): close finished ones")
        name = task.environment or self.config.name
        factory = environment_factory(name)
        self._starting += 1
        try:
            environment, observation = await self._in_environment(name, "Reset", _make_and_reset, factory, task,
                                                                  self.config)
        finally:
            self._starting -= 1
        who = f"environment {name!r}"
        try:
            check_observation(observation, self.config.max_observation_bytes, who)
            tools = list(environment.tools)
            if not all(isinstance(tool, ToolSpec) for tool in tools):
                raise InvalidArgument(f"{who} has tools that are not ToolSpecs: {tools!r:.200}")
        except InvalidArgument:
            await self._on_thread(_close_quietly, environment)
            raise
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = _OpenSession(environment, name, last_used=self.clock())
        self.counters.sessions_started += 1
        self._sessions_total.inc()
        return Session(session_id, observation, tools)

    def check_action(self, action: Action) -> None:
        """ResourceExhausted for a turn above env.max_action_bytes or env.max_tool_calls_per_step."""
        size = action.size_bytes()
        if size > self.config.max_action_bytes:
            raise ResourceExhausted(f"the action has {size} bytes; the limit is env.max_action_bytes="
                                    f"{self.config.max_action_bytes}")
        if len(action.tool_calls) > self.config.max_tool_calls_per_step:
            raise ResourceExhausted(f"the action has {len(action.tool_calls)} tool calls; the limit is "
                                    f"env.max_tool_calls_per_step={self.config.max_tool_calls_per_step}")

    async def step(self, session_id: str, action: Action) -> StepResult:
        """Applies one model turn to an open, unfinished, idle session."""
        self._check_started()
        self.check_action(action)
        session = self._open_session(session_id)
        if session.done:
            raise FailedPrecondition(f"session {session_id} is done: Close it (or Reset a new one)")
        if session.busy:
            raise FailedPrecondition(f"session {session_id} is running a Step already: one at a time")
        if session.steps >= self.config.max_steps_per_session:
            raise FailedPrecondition(f"session {session_id} took {session.steps} steps, the limit "
                                     "(env.max_steps_per_session)")
        session.busy = True
        try:
            result = await self._in_environment(session.name, "Step", session.environment.step, action)
            check_step_result(result, self.config.max_observation_bytes, f"environment {session.name!r}")
        except BaseException as error:  # the environment's state is unknown now: the session ends
            await self._drop(session_id, f"its Step failed ({type(error).__name__})")
            raise
        session.busy = False
        session.steps += 1
        session.done = result.done
        session.last_used = self.clock()
        self.counters.steps += 1
        self._steps_total.labels(status=result.status).inc()
        return result

    async def close(self, session_id: str) -> None:
        """Closes an open session; NotFound if it is not open."""
        self._open_session(session_id)
        await self._drop(session_id, "it was closed by a Close call")

    def status(self) -> EnvStatus:
        return EnvStatus(registered_environments(), len(self.sessions), self.counters.sessions_started,
                         self.counters.sessions_expired, self.counters.steps)

    # --- idle sessions ---

    async def close_idle_sessions(self) -> int:
        """Closes the sessions idle past env.session_idle_timeout_s (not one running a call); how many."""
        now = self.clock()
        timeout = self.config.session_idle_timeout_s
        idle = [session_id for session_id, session in self.sessions.items()
                if not session.busy and now - session.last_used > timeout]
        for session_id in idle:
            await self._drop(session_id, f"it idled past env.session_idle_timeout_s={timeout:g} s")
            self.counters.sessions_expired += 1
            self._expired_total.inc()
        return len(idle)

    async def _close_idle_sessions_forever(self) -> None:
        period = min(1.0, self.config.session_idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self.close_idle_sessions()
            except Exception:  # never let the reaper die: log and go on
                log.exception("closing idle sessions failed")

    # --- helpers ---

    def _check_started(self) -> None:
        if not self._started:
            raise Unavailable("the environment engine is not started (or already stopped)")

    def _open_session(self, session_id: str) -> _OpenSession:
        session = self.sessions.get(session_id)
        if session is None:
            why = self.counters.closed_why.get(session_id)
            raise NotFound(f"session {session_id!r:.80} was closed: {why}" if why
                           else f"no session {session_id!r:.80} (never opened, or closed long ago)")
        return session

    async def _drop(self, session_id: str, why: str) -> None:
        """Removes a session, remembers why, and closes its environment (errors logged, never raised)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        self.counters.closed_why[session_id] = why
        while len(self.counters.closed_why) > REMEMBERED_CLOSED:
            self.counters.closed_why.popitem(last=False)
        try:  # bounded: a hanging close must not hold up the reaper or the caller
            await asyncio.wait_for(self._on_thread(_close_quietly, session.environment), self.config.step_timeout_s)
        except TimeoutError:
            log.warning("closing session %s of environment %r ran past env.step_timeout_s; left behind",
                        session_id, session.name)

    def _on_thread(self, fn, *args) -> asyncio.Future:
        """fn(*args) on one of the engine's env.threads threads."""
        return asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def _in_environment(self, name: str, call: str, fn, *args):
        """fn(*args) on a thread within env.step_timeout_s; DeadlineExceeded past it, Internal when the
        environment raises something other than an rlfabric error."""
        timeout = self.config.step_timeout_s
        try:
            return await asyncio.wait_for(self._on_thread(fn, *args), timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"environment {name!r}: {call} ran past env.step_timeout_s={timeout:g} s; "
                                   "the session is closed") from None
        except RlfabricError:
            raise
        except Exception as error:
            log.exception("environment %r failed in %s", name, call)
            raise Internal(f"environment {name!r} failed in {call}: {type(error).__name__}: {error}"[:500]) from None


def _make_and_reset(factory, task: Task, config: EnvConfig):
    environment = factory(task, config)
    return environment, environment.reset()


def _close_quietly(environment: Environment) -> None:
    try:
        environment.close()
    except Exception:
        log.exception("closing an environment failed")
