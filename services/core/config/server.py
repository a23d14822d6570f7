"""The sections of the mesh itself: server (gRPC, TLS, auth), client, cluster (where the services are), storage, tracing."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from rlfabric.core.config.base import Section


class TlsConfig(Section):
    cert_file: str = ""
    """PEM certificate of this service; empty = plaintext (fine on loopback)."""
    key_file: str = ""
    """PEM private key of cert_file."""
    ca_file: str = ""
    """PEM CA bundle: servers use it to verify client certs (mTLS), clients to verify servers."""
    require_client_cert: bool = False
    """mTLS: refuse clients without a certificate signed by ca_file."""
    server_name: str = ""
    """Clients: override the name checked against the server certificate (e.g. 'localhost')."""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


class ServerConfig(Section):
    """How every service serves gRPC: address, message limits, keepalive, TLS and the bearer token."""

    host: str = "127.0.0.1"
    """Address services bind to; 0.0.0.0 in a container."""
    max_receive_message_mb: int = Field(256, gt=0)
    """Largest request of a method that carries batches, prompts or weights (MiB); bigger ones get
    RESOURCE_EXHAUSTED. Stream larger data."""
    max_control_message_kb: int = Field(4096, gt=0)
    """Largest request of any other method (KiB): an env Step, a status, a path, a run's overrides. A service
    with no batch, prompt or weight method (env, coordinator) refuses a bigger one before reading it."""
    max_send_message_mb: int = Field(256, gt=0)
    """Largest response a service sends (MiB)."""
    grace_period_s: float = Field(30.0, ge=0)
    """On SIGTERM, in-flight RPCs get this long to finish before they are cancelled."""
    keepalive_time_s: float = Field(30.0, gt=0)
    """HTTP/2 keepalive ping interval, so dead peers are noticed on idle connections."""
    keepalive_timeout_s: float = Field(10.0, gt=0)
    """A keepalive ping unanswered this long closes the connection."""
    max_concurrent_rpcs: int = Field(256, ge=0)
    """Most RPCs a service runs at once; more get RESOURCE_EXHAUSTED (health/reflection exempt); 0 = no limit."""
    tls: TlsConfig = TlsConfig()
    """TLS / mTLS for every service and client."""
    auth_token_file: str = ""
    """File holding a bearer token every RPC must carry (health/reflection exempt); empty = no auth.
    `rlfabric up`/`train` create one per mesh (RUN_DIR/auth_token, mode 0600) when this is empty."""
    allow_insecure: bool = False
    """Serve on a non-loopback address without TLS and a token. Off, `rlfabric serve` refuses to: anyone
    who reaches the port could drive the service, and a token would cross the network in clear."""
    log_level: str = "INFO"
    """Python logging level of the services."""


class ClientConfig(Section):
    """How every client calls a service: deadlines, connection wait and retries."""

    timeout_s: float = Field(600.0, gt=0)
    """Default deadline of every RPC a client makes (seconds); no call waits forever."""
    connect_timeout_s: float = Field(60.0, gt=0)
    """How long a client waits for a peer to become ready."""
    retry_max_attempts: int = Field(5, ge=1, le=5)
    """Attempts (first try included) for calls failing with UNAVAILABLE (gRPC retry policy)."""
    retry_initial_backoff_s: float = Field(0.2, gt=0)
    """First retry delay; doubles per attempt up to 5 s."""


class ClusterConfig(Section):
    """gRPC addresses ("host:port") of each role; filled in by `rlfabric up` or the Helm chart."""

    actor: list[str] = []
    """Actor service address(es)."""
    reference: list[str] = []
    """Reference service address(es)."""
    critic: list[str] = []
    """Critic service address(es)."""
    teacher: list[str] = []
    """Teacher service address(es) (algorithm.distill)."""
    rollout: list[str] = []
    """Rollout replicas; the coordinator routes over all of them."""
    reward: list[str] = []
    """Reward service address(es)."""
    judge: list[str] = []
    """Judge replicas (the judge section's pool); the reward service calls them (reward.judge.addresses)."""
    env: list[str] = []
    """Environment service address(es) (multi-turn rollouts)."""
    coordinator: list[str] = []
    """Coordinator address (for `rlfabric status` and external clients)."""


class StorageConfig(Section):
    """Where the paths an RPC names may lie (checkpoints, exports, data files)."""

    root: str = ""
    """Every path that arrives over RPC (the actor's checkpoint and export paths, StartRun's data files and
    trainer.resume_from_path) must resolve, symlinks included, under this directory (relative ones are
    taken from it); others are PERMISSION_DENIED. Empty = the folder holding trainer.run_dir (the launchers'
    runs/), or ./runs."""

    def resolved_root(self, run_dir: str) -> Path:
        if self.root:
            return Path(self.root).resolve()
        return Path(run_dir).resolve().parent if run_dir else Path("runs").resolve()


class TracingConfig(Section):
    """OpenTelemetry traces of every RPC and of each training step's phases (rlfabric.core.tracing)."""

    endpoint: str = ""
    """OTLP/gRPC collector address ("host:4317"); empty = tracing off (no tracer, no interceptors)."""
    service_name_prefix: str = "rlfabric-"
    """Each service reports as service.name prefix + role, e.g. rlfabric-actor."""
    sample_ratio: float = Field(1.0, ge=0, le=1)
    """Fraction of traces kept, decided where one starts (a step's root span); callees follow the caller."""
    insecure: bool = True
    """Plaintext gRPC to the collector (the OpenTelemetry Collector's default receiver); false = TLS."""
    ca_file: str = ""
    """With insecure false: PEM CA bundle verifying the collector's certificate; empty = system roots."""
