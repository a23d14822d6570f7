"""agent: existing agent code trained through the OpenAI-compatible gateway (rlfabric.gateway)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlfabric.core.config.base import Section


class GatewayConfig(Section):
    enable: bool = False
    """Start the gateway with the run: an OpenAI-compatible endpoint in the coordinator's process, in front of the
    rollout replicas, that records every call of an episode as token ids (docs/agents-gateway.md)."""
    host: str = "127.0.0.1"
    """Address the gateway listens on (loopback: only agents on this host reach it)."""
    port: int = Field(0, ge=0, le=65535)
    """Port the gateway listens on; 0 = a free one, chosen when it starts."""
    served_model_name: str = ""
    """The model name GET /v1/models lists and responses carry; empty = the last folder of model.path. Requests
    may name any model: agent code written for another name runs unchanged."""
    max_concurrent_episodes: int = Field(1024, ge=1)
    """Most episodes open at once; opening one more is RESOURCE_EXHAUSTED."""
    max_inflight_calls: int = Field(256, ge=1)
    """Most calls generating at once over all episodes; more get 429 with a retry-after-ms header (the SDKs wait
    and retry)."""
    retry_after_ms: int = Field(200, ge=1)
    """The wait a 429 asks for."""
    max_calls_per_episode: int = Field(64, ge=1)
    """Most recorded calls of one episode; a call beyond is 400 (code episode_call_limit)."""
    max_tokens_per_episode: int = Field(16384, ge=1)
    """Most sampled tokens of one episode; a call's max_tokens is cut to what is left, and a call with none left
    is 400 (code episode_token_limit)."""
    max_tokens_per_call: int = Field(0, ge=0)
    """max_tokens of a call that names none, and the most one may ask; 0 = rollout.response_length (or
    data.max_response_length)."""
    episode_timeout_s: float = Field(3600.0, gt=0)
    """An episode open this long times out: its calls then get 410 (code episode_timed_out) and it is marked so."""
    call_timeout_s: float = Field(600.0, gt=0)
    """Most seconds one call may take at the rollout, its wait at a replica paused for a weight sync included (calls
    wait through syncs; they do not fail). Past it the call is 503 (code call_timeout) with retry-after, not
    recorded, and counted in agent/call_timeouts; the SDKs retry it. Keep it below rollout.request_timeout_s, past
    which the router takes a replica out as stuck."""
    tool_call_format: Literal["hermes", "qwen3_xml", "llama3_json", "none"] = "hermes"
    """How tool calls are read from a reply when the request declares tools (vLLM's tool-call-parser names):
    hermes = <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen2.5, Qwen3, SmolLM2);
    qwen3_xml = <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call> (Qwen3-Coder;
    vLLM's qwen3_coder); llama3_json = the reply is {"name": ..., "parameters": {...}} (Llama 3.1, 3.2); none =
    never (the reply is plain text). Checked at start against the model's chat template (a call rendered and
    parsed back): a mismatch is a config error. A call that does not parse leaves the whole reply as plain
    text, counted in agent/tool_parse_errors."""
    honour_agent_sampling: bool = False
    """Use the temperature, top_p and top_k an agent sends. Off: the run's (rollout.*) replace them, so the
    recorded log-probs match the trainer's, and each call that sent others counts in agent/sampling_overrides."""
    closed_episodes_remembered: int = Field(65536, ge=1)
    """Keys of closed episodes kept to answer 410 (not 401); the oldest are forgotten first."""


class SubprocessConfig(Section):
    preload: bool = True
    """Run the subprocess runner's episodes from a warm host: one process, started with the first episode, that
    imports the installed packages the entrypoint's file imports (openai, verifiers: 1 to 8 CPU seconds a new
    interpreter spends per episode) and forks a child per episode, confined as a new process would be (its uid,
    limits, private temp dirs, network; rlfabric.agents.forkserver). The entrypoint's own file runs only in the
    confined child. False = a new interpreter per episode (`python -m rlfabric.agents.host`)."""


class AgentConfig(Section):
    gateway: GatewayConfig = GatewayConfig()
    """The OpenAI-compatible endpoint agent code calls (its base URL and a per-episode key)."""
    entrypoint: str = ""
    """The agent the run trains: `path/to/agent.py:run` or `package.module:run`, an `async def run(task, llm)`.
    task: the row's prompt `messages` and public fields (data_source, ability, uid, extra_info; never the ground truth);
    llm: `base_url`, `api_key` (the episode's key) and `model`. It returns a reward (a number), a dict with
    reward and/or answer (and metrics), or an answer (a string) the reward service scores by the row's
    data_source. Each (prompt, sample) is one episode; the gateway starts with the run. Empty = no agent."""
    runner: Literal["inline", "subprocess", "command", "service"] = "inline"
    """Where an episode runs: inline = awaited in the coordinator's event loop; subprocess = a Python process of
    its own per episode, with OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL set (a plain AsyncOpenAI() works),
    its result as JSON on stdout; command = agent.command, any language, the same variables, the task as JSON on
    stdin and its result as JSON on stdout's last line; service = a RunEpisode per episode on the agent host at
    agent.address (AgentService, protos/rlfabric/v1/agent.proto: a host in any language)."""
    subprocess: SubprocessConfig = SubprocessConfig()
    """How the subprocess runner starts its episodes' processes."""
    command: list[str] = []
    """The command line of runner command (e.g. [node, agent.js]); run in agent.working_dir."""
    address: str = ""
    """host:port of the AgentService that runs the episodes of runner service."""
    auth_token_file: str = ""
    """A file holding the token of the agent host (`rlfabric serve agent`): the host requires it on RunEpisode and
    runner service sends it. Its own, never the mesh's (server.auth_token_file): agent code runs on the host.
    Empty = none (the host then serves loopback only, unless server.allow_insecure)."""
    working_dir: str = ""
    """The working directory of subprocess and command agents; empty = the coordinator's."""
    private_tmp: bool = True
    """Subprocess and command agents get empty /tmp, /var/tmp and /dev/shm of their own (a mount namespace made
    before the agent's program starts; tmpfs, each at most agent.memory_limit_mb, gone with the episode), so
    episodes never see each other's files nor the host theirs. Files the agent reads belong elsewhere: its program,
    its entrypoint's folder and its working directory stay reachable (bound in where they lay under /tmp)."""
    uid: int = Field(64320, ge=1)
    """First uid of the agents' range (root only): each subprocess or command episode runs its process tree as a
    uid of uid .. uid + uid_count - 1 of its own, one no other episode, reward worker, python call or process uses,
    so it cannot read root's 0600 files nor signal anything but its own processes, which are killed (and its files
    in the temp dirs deleted) when the episode ends. Keep the range apart from reward.custom_sandbox's and
    env.python.sandbox's, and below 65536."""
    uid_count: int = Field(256, ge=1)
    """How many uids the range holds: at least the episodes that may run at once on this machine
    (agent.max_concurrent_episodes); a uid some process already runs as is skipped."""
    gid: int = Field(65534, ge=1)
    """Group of agent processes when the service runs as root (65534 = nogroup); no supplementary groups."""
    require_sandbox_uid: bool = False
    """Refuse to start subprocess and command agents where they cannot have a uid of their own (the service is not
    root); false = log a warning and run them as the service's uid, which can read what the service can."""
    memory_limit_mb: int = Field(4096, ge=0)
    """RLIMIT_DATA of each process of a subprocess or command agent (MiB: its private writable memory, not address
    space, which node's WebAssembly reserves by the 10 GiB; a hog gets MemoryError or ENOMEM and its
    episode fails), and the most each of its private temp dirs holds; 0 = no limit."""
    max_processes: int = Field(128, ge=8)
    """RLIMIT_NPROC of an agent (root only): most processes and threads of one episode's uid."""
    max_open_files: int = Field(1024, ge=16)
    """RLIMIT_NOFILE of an agent: most file descriptors one of its processes may hold (each open connection to the
    gateway is one)."""
    max_file_mb: int = Field(256, ge=1)
    """RLIMIT_FSIZE of an agent: largest file it may write (MiB); writing more fails with EFBIG."""
    cpu_limit_s: int = Field(600, ge=1)
    """RLIMIT_CPU of each agent process: CPU seconds (all its threads together); past it SIGXCPU, then SIGKILL a
    second later, and its episode fails. agent.timeout_s bounds the episode's wall time."""
    network_isolation: bool = True
    """Subprocess and command agents get a network namespace of their own where only the gateway answers (at the
    same 127.0.0.1:port, relayed by rlfabric.agents.jail): no other port of this host, no outside address. Needs
    root; elsewhere a warning on the agent's stderr, and it has this host's network."""
    require_network_isolation: bool = False
    """Where no network namespace can be made (not root, a kernel that refuses), fail each subprocess or command
    episode (agent/failed/exited) instead of running the agent with this host's network."""
    max_concurrent_episodes: int = Field(256, ge=1)
    """Most episodes running at once (with subprocess and command: processes); the others wait their turn.
    agent.gateway.max_concurrent_episodes and what the replicas admit (rollout.max_pending_requests x
    rollout.replicas: an episode has one call in flight at a time) bound it too."""
    timeout_s: float = Field(600.0, gt=0)
    """An episode running longer is cancelled (its process killed) and marked failed: masked, counted in
    agent/failed/timeout, and the run goes on."""

    def runs_agents(self) -> bool:
        """The run's samples are agent episodes (agent.entrypoint; with runner command agent.command, with runner
    service agent.address)."""
        what = {"command": self.command, "service": self.address}.get(self.runner, self.entrypoint)
        return bool(what)

    @model_validator(mode="after")
    def _runner_has_what_it_runs(self) -> AgentConfig:
        if self.runner == "command" and self.entrypoint and not self.command:
            raise ValueError("agent.runner command runs agent.command (a command line), not agent.entrypoint: "
                             "set agent.command")
        if self.runner == "service" and not self.address:
            raise ValueError("agent.runner service asks the AgentService at agent.address: set agent.address")
        if self.runner in ("subprocess", "command") and self.uid_count < self.max_concurrent_episodes:
            raise ValueError(f"agent.uid_count {self.uid_count} < agent.max_concurrent_episodes "
                             f"{self.max_concurrent_episodes}: each running episode needs a uid of its own")
        if self.runner != "command" and self.command and not self.entrypoint:
            raise ValueError(f"agent.command is set but agent.runner is {self.runner}: set agent.runner command")
        return self
