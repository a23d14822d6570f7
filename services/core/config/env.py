"""env: the environment service and its python tool."""

from __future__ import annotations

from pydantic import Field

from rlfabric.core.config.base import Section
from rlfabric.core.config.reward import PythonSandboxConfig


class PythonToolConfig(Section):
    timeout_s: float = Field(5.0, gt=0)
    """Longest one run of the python tool's code may take (wall clock); then it is killed and the model reads a timeout. Keep it below env.step_timeout_s, which would otherwise end the Step first."""
    memory_limit_mb: int = Field(512, ge=0)
    """Memory cap of one call (MiB; 0 = none): each of its processes' address space (RLIMIT_AS) and all of them together (see sandbox.memory_cgroup: past it the call is killed and the model reads why)."""
    max_output_bytes: int = Field(8192, ge=256)
    """stdout and stderr the model reads back, together; the rest is cut off (and says so)."""
    sandbox: PythonSandboxConfig = PythonSandboxConfig()
    """The confinement of the code: the reward sandbox's settings (reward.custom_sandbox), applied the same way, with a uid range of its own and a private /tmp per call."""


class EnvConfig(Section):
    """The environment service of multi-turn rollouts: its tools, sessions and token."""

    enable: bool = False
    """Start an environment service with the mesh (`rlfabric up`, the local and Ray launchers), or take one
    given with --external env=HOST:PORT; the rollout replicas call it when rollout.multi_turn.enable."""
    name: str = "calculator"
    """Environment of a task that names none: calculator, python, lookup, or one an environment module registered."""
    environment_modules: list[str] = []
    """Modules the env service imports at start, so their register_environment calls add environments."""
    max_sessions: int = Field(1024, ge=1)
    """Most sessions open at once; a Reset beyond gets RESOURCE_EXHAUSTED."""
    session_idle_timeout_s: float = Field(300.0, gt=0)
    """A session with no call for this long is closed (its next call gets NOT_FOUND)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Longest Reset or Step may take in the environment; past it the call gets DEADLINE_EXCEEDED and the session is closed."""
    threads: int = Field(64, ge=1)
    """Threads that run environment calls (each Reset, Step and Close runs on one); more calls at once wait for a free one."""
    max_action_bytes: int = Field(65536, ge=1)
    """Largest model turn (text and tool calls) a Step takes; larger gets RESOURCE_EXHAUSTED."""
    max_tool_calls_per_step: int = Field(8, ge=1)
    """Most tool calls in one model turn; more gets RESOURCE_EXHAUSTED."""
    max_observation_bytes: int = Field(65536, ge=1)
    """Largest observation an environment may return; larger is the environment's fault (INVALID_ARGUMENT)."""
    max_steps_per_session: int = Field(64, ge=1)
    """Most Steps of one session; more get FAILED_PRECONDITION."""
    auth_token_file: str = ""
    """File holding the bearer token of the environment link: the env service requires it, and the rollout
    replicas and the coordinator send it to the environment instead of the mesh's token
    (server.auth_token_file), which an environment never gets; empty = no token on that link.
    `rlfabric up`/`train` create one (RUN_DIR/env_token, 0600) when the mesh has a token."""
    python: PythonToolConfig = PythonToolConfig()
    """The python environment's code execution."""
    pool: str = ""
    """Key of resource_pools this role runs on; empty = no pool (every device of the machine, as before)."""
