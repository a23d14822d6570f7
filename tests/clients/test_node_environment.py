"""The Node.js environment (examples/clients/node/env_server.js, @grpc/grpc-js) served for real and
driven by the Python EnvClient over gRPC: an episode, bad tool calls as observations, every failure
with its status, and an environment that breaks the contract caught by the client as INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rlfabric.core.client import ChannelOptions, wait_until_serving
from rlfabric.core.config import load_config
from rlfabric.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from rlfabric.env.client import EnvClient
from rlfabric.env.items import (
    STEP_INVALID_ARGUMENTS,
    STEP_OK,
    STEP_UNKNOWN_TOOL,
    Action,
    Message,
    Task,
    ToolCall,
)
from rlfabric.launch.local import LocalMesh, service_names
from tests.coordinator.meshes import run_to_the_end
from tests.waiting import wait_until

CLIENT_DIR = Path(__file__).parents[2] / "examples" / "clients" / "node"
NODE = shutil.which("node")
TOKEN = "node-env-test-token"  # the environment link's (env.auth_token_file), which the Node service checks
MESH_TOKEN = "node-env-test-mesh-token"  # the mesh's: the environment never sees it

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NODE is None, reason="node is not installed (`make system-deps` installs it)")]
# A server of environments that break the contract or never answer, built on env_server.js.
MISBEHAVING = """
const { serveEnvironments } = require(%(env_server)s);
const ok = { observation: { messages: [] }, reward: 0, done: false, status: "STEP_STATUS_OK", metrics: {} };
class Broken {
  constructor(task) { this.kind = task.prompt; this.tools = []; }
  reset() { return []; }
  step() {
    if (this.kind === "nan reward") return { ...ok, reward: NaN };
    if (this.kind === "assistant message") return { ...ok, observation: { messages: [{ role: "assistant", content: "hi" }] } };
    if (this.kind === "no status") return { ...ok, status: "STEP_STATUS_UNSPECIFIED" };
    if (this.kind === "hang") return new Promise(() => {});
    return ok;
  }
}
serveEnvironments({ broken: Broken }, { stepTimeoutS: 0.5 }).then(({ port }) => console.log(`listening on 127.0.0.1:${port}`));
"""


@pytest.fixture(scope="module")
def node_modules():
    """The pinned dependencies from package-lock.json, installed (npm ci) if missing."""
    if not (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        assert npm, "node is installed but npm is not"
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT_DIR, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr


def _start_node(processes: list[subprocess.Popen], args: list[str], **env: str) -> str:
    """Runs node with args (the process joins `processes`), returns the address it listens on."""
    process = subprocess.Popen([NODE, *args], cwd=CLIENT_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "RLFABRIC_TOKEN": TOKEN, **env})
    processes.append(process)
    line = process.stdout.readline()  # blocks until the server is bound (or node exits)
    assert line.startswith("listening on "), line + process.stderr.read()
    return line.split()[-1]


def _stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


@pytest.fixture
def start_node(node_modules):
    """Factory: start_node(args, **env) runs node with args, returns the address it listens on."""
    processes: list[subprocess.Popen] = []
    yield lambda args, **env: _start_node(processes, args, **env)
    _stop_all(processes)


def call(address: str, method: str, *args, token: str = TOKEN, **kwargs):
    async def run():
        async with EnvClient(address, ChannelOptions(auth_token=token, retry_max_attempts=1)) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run())


def guess(number) -> Action:
    return Action("", (ToolCall("guess", json.dumps({"number": number})),))


def test_an_episode_against_the_node_environment(start_node):
    address = start_node(["env_server.js"])
    session = call(address, "reset", Task("guess", ground_truth="37"))
    assert session.observation == [Message("user", "I am thinking of a number. Call guess(number) to narrow it down.")]
    assert [tool.name for tool in session.tools] == ["guess"]
    assert session.tools[0].parameters["required"] == ["number"]
    answers = [call(address, "step", session.session_id, guess(n)).observation[0].content for n in (50, 25, 37)]
    assert answers == ["lower", "higher", "correct"]
    final = call(address, "step", session.session_id, Action("#### 37"))
    assert (final.done, final.reward, final.status, final.metrics) == (True, 1.0, STEP_OK, {"guesses": 3.0})
    with pytest.raises(FailedPrecondition, match="is done"):
        call(address, "step", session.session_id, guess(1))
    status = call(address, "status")
    assert (status.environments, status.sessions_open, status.sessions_started, status.steps) == (["guess"], 1, 1, 4)
    call(address, "close_session", session.session_id)
    with pytest.raises(NotFound, match="closed by a Close call"):
        call(address, "step", session.session_id, guess(1))


def test_bad_tool_calls_are_observations_in_node_too(start_node):
    address = start_node(["env_server.js"])
    session = call(address, "reset", Task("guess", ground_truth="5"))
    unknown = call(address, "step", session.session_id, Action("", (ToolCall("peek", "{}"),)))
    assert (unknown.status, unknown.observation[0].content) == (STEP_UNKNOWN_TOOL, "error: unknown tool 'peek'; tools: guess")
    malformed = call(address, "step", session.session_id, Action("", (ToolCall("guess", "{number: 3"),)))
    assert malformed.status == STEP_INVALID_ARGUMENTS and "not JSON" in malformed.observation[0].content
    assert call(address, "step", session.session_id, guess(5)).observation[0].content == "correct"


def test_node_environment_failures_have_their_status(start_node):
    address = start_node(["env_server.js"])
    with pytest.raises(NotFound, match="no session 'nope'"):
        call(address, "step", "nope", guess(1))
    with pytest.raises(InvalidArgument, match="unknown environment 'chess'"):
        call(address, "reset", Task("chess"))
    with pytest.raises(InvalidArgument, match="ground_truth must be an integer"):
        call(address, "reset", Task("guess", ground_truth="many"))
    with pytest.raises(Unauthenticated):
        call(address, "status", token="wrong")
    session = call(address, "reset", Task("guess", ground_truth="5"))
    with pytest.raises(ResourceExhausted, match="the limit is 65536"):
        call(address, "step", session.session_id, Action("x" * 70_000))
    assert call(address, "step", session.session_id, guess(5)).observation[0].content == "correct"


def test_node_environment_closes_idle_sessions(start_node):
    address = start_node(["env_server.js"], RLFABRIC_ENV_IDLE_TIMEOUT_S="0.3")
    session = call(address, "reset", Task("guess", ground_truth="5"))
    wait_until(lambda: call(address, "status").sessions_expired == 1, 10, "the idle session to be closed")
    with pytest.raises(NotFound, match="idled past 0.3 s"):
        call(address, "step", session.session_id, guess(5))


@pytest.fixture
def misbehaving(start_node, tmp_path):
    script = tmp_path / "misbehaving.js"
    script.write_text(MISBEHAVING % {"env_server": json.dumps(str(CLIENT_DIR / "env_server.js"))})
    return start_node([str(script)])


@pytest.mark.parametrize("kind", ["nan reward", "assistant message", "no status"])
def test_a_node_environment_answering_garbage_is_invalid_argument_for_the_caller(misbehaving, kind):
    session = call(misbehaving, "reset", Task("broken", prompt=kind))
    with pytest.raises(InvalidArgument, match=f"the environment service at {misbehaving}"):
        call(misbehaving, "step", session.session_id, Action("hi"))
    fine = call(misbehaving, "reset", Task("broken", prompt="fine"))
    assert call(misbehaving, "step", fine.session_id, Action("hi")).status == STEP_OK


def test_a_node_environment_that_never_answers_fails_the_call_not_the_caller(misbehaving):
    session = call(misbehaving, "reset", Task("broken", prompt="hang"))
    with pytest.raises(DeadlineExceeded, match=r"\(Step, deadline 0\.2 s\)"):  # the caller's own deadline
        call(misbehaving, "step", session.session_id, Action("hi"), timeout_s=0.2)
    other = call(misbehaving, "reset", Task("broken", prompt="hang"))
    with pytest.raises(DeadlineExceeded, match="ran past 0.5 s"):  # the environment service's step timeout
        call(misbehaving, "step", other.session_id, Action("hi"), timeout_s=10)
    with pytest.raises(NotFound, match="its Step failed"):
        call(misbehaving, "step", other.session_id, Action("hi"))


def token_files(folder) -> list[str]:
    """Overrides naming the mesh's token and the environment link's, each in a 0600 file."""
    overrides = []
    for key, token in (("server.auth_token_file", MESH_TOKEN), ("env.auth_token_file", TOKEN)):
        path = folder / key.split(".")[0]
        path.write_text(token)
        path.chmod(0o600)
        overrides.append(f"{key}={path}")
    return overrides


@pytest.fixture(scope="module")
def live_mesh(node_modules, tmp_path_factory):
    """One LocalMesh for the module's two live-mesh tests (a mesh boot is most of their time), its env role the
    Node environment (`--external env=ADDRESS`), configured for the multi-turn run: the environment's token and
    the mesh's, one step of 4 guess prompts from a parquet file, two turns. Yields (mesh, the Node address)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("node-env-mesh")
    rows = [{"data_source": "guess", "prompt": [{"role": "user", "content": "Find my number."}], "ability": "tool",
             "reward_model": {"style": "rule", "ground_truth": str(n)}, "extra_info": {"environment": "guess"}}
            for n in range(16)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "guess.parquet")
    processes: list[subprocess.Popen] = []
    try:
        address = _start_node(processes, ["env_server.js"])
        config = load_config(None, ["env.enable=true", *token_files(folder), "trainer.total_steps=1",
                                    f"data.train_files=[{folder / 'guess.parquet'}]", "data.train_batch_size=4",
                                    "actor.ppo_mini_batch_size=4", "rollout.multi_turn.enable=true",
                                    "rollout.multi_turn.max_turns=2", "rollout.multi_turn.max_total_tokens=160",
                                    "data.max_response_length=16", "trainer.progress_bar=false",
                                    "trainer.dump_rollouts=true"])
        with LocalMesh(config, folder / "run", external={"env": [address]}) as mesh:
            yield mesh, address
    finally:
        _stop_all(processes)


def test_the_node_environment_is_the_env_role_of_a_live_mesh(live_mesh):
    """`rlfabric up --external env=ADDRESS`: the mesh takes the Node environment as its env role, the
    launcher's readiness check and the environment's token work with it, and the resolved config names it."""
    mesh, address = live_mesh
    resolved = yaml.safe_load((mesh.run_dir / "config.resolved.yaml").read_text())
    assert resolved["cluster"]["env"] == [address]
    assert "env" not in mesh.endpoints  # served by Node, not launched

    async def episode():
        options = ChannelOptions.for_env(mesh.config)
        await wait_until_serving(address, options, timeout_s=10)
        async with EnvClient(address, options) as client:
            session = await client.reset(Task("guess", ground_truth="2"))
            return await client.step(session.session_id, guess(2))

    assert asyncio.run(episode()).observation[0].content == "correct"


def test_the_launchers_start_an_env_service_only_when_enabled():
    assert ("env", "env") not in service_names(load_config(None))
    assert ("env", "env") in service_names(load_config(None, ["env.enable=true"]))


@pytest.mark.slow
def test_a_multi_turn_run_trains_against_the_node_environment_in_a_live_mesh(live_mesh):
    """rollout.multi_turn with the Node environment as the mesh's env role: the rollout replicas' agent loops
    call it over gRPC (with the environment's token, not the mesh's), its first observation comes back as
    masked tokens, and a training step completes with no sample failed by the environment."""
    from rlfabric.v1 import coordinator_pb2

    mesh, _ = live_mesh
    metrics, status = run_to_the_end(mesh)
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    step = metrics[-1]
    assert step["agent/env_failed/count"] == 0 and step["agent/turns/mean"] >= 1, step
    assert step["agent/model_token_fraction"] < 1  # the Reset's observation: the environment's tokens
