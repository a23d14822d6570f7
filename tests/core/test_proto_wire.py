"""The protos' renames (protos/README.md: common.proto, <Service><Rpc>Request names) changed nothing on the wire.

The protos before them are those of the parent of the commit that added common.proto (from git). Three checks:
- every message, enum and RPC of then has its counterpart now, field for field (all 60 renamed messages);
- stubs generated from the protos of then call today's servers, one of each role, every RPC but PushWeights
  (tests/core/wire_calls.py, in a process of its own: the two sets of stubs cannot share one protobuf pool);
- today's stubs call the reward and environment services of then (their code at that commit, served by
  `python -m rlfabric serve`): the other direction.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from rlfabric.core.server import ServerOptions
from rlfabric.launch.local import prepare_run_dir
from rlfabric.serve import build_service
from rlfabric.tools.protogen import PROTO_ROOT, REPO_ROOT, generate
from tests.conftest import ServerThread
from tests.coordinator.meshes import fast_config
from tests.waiting import wait_until

WIRE_CALLS = Path(__file__).with_name("wire_calls.py")
PACKAGE = ".rlfabric.v1."


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, check=True).stdout


def before_the_renames() -> str:
    """The last commit whose protos have no common.proto: the parent of the commit that added it."""
    added = _git("log", "--diff-filter=A", "--format=%H", "--", "protos/rlfabric/v1/common.proto").split()
    return f"{added[-1].decode()}^"


def checkout(paths: str, into: Path) -> Path:
    """`paths` (a folder of the repository) as it was before the renames, extracted under `into`."""
    with tarfile.open(fileobj=io.BytesIO(_git("archive", before_the_renames(), paths))) as archive:
        archive.extractall(into, filter="data")
    return into / paths


def descriptors(proto_root: Path, out: Path) -> descriptor_pb2.FileDescriptorSet:
    """The FileDescriptorSet of proto_root/rlfabric/v1/*.proto, written to `out` by protoc."""
    protos = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "rlfabric" / "v1").glob("*.proto"))
    assert protoc.main(["protoc", f"-I{proto_root}", f"--descriptor_set_out={out}", *protos]) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _messages(files: descriptor_pb2.FileDescriptorSet) -> dict[str, descriptor_pb2.DescriptorProto]:
    """Every message by full name (".rlfabric.v1.Sample"), nested ones (map entries) included."""
    found = {}

    def add(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        found[prefix + message.name] = message
        for nested in message.nested_type:
            add(f"{prefix}{message.name}.", nested)

    for file in files.file:
        for message in file.message_type:
            add(PACKAGE, message)
    return found


def _methods(files: descriptor_pb2.FileDescriptorSet) -> dict[str, descriptor_pb2.MethodDescriptorProto]:
    return {f"{service.name}.{method.name}": method
            for file in files.file for service in file.service for method in service.method}


def test_every_message_enum_and_rpc_of_then_has_an_equal_one_now(tmp_path):
    """Field numbers, types, labels and names (JSON too) of every message of then, under its name now."""
    old = descriptors(checkout("protos", tmp_path), tmp_path / "old.pb")
    new = descriptors(PROTO_ROOT, tmp_path / "new.pb")
    old_methods, new_methods = _methods(old), _methods(new)
    renamed = {}  # full name then -> full name now
    for name, method in old_methods.items():
        now = new_methods[name]  # no RPC went away
        assert (now.client_streaming, now.server_streaming) == (method.client_streaming, method.server_streaming)
        renamed[method.input_type], renamed[method.output_type] = now.input_type, now.output_type

    def now_named(full_name: str) -> str:
        """A message's name now; one nested in a renamed message (a map entry) moves with it."""
        top, dot, nested = full_name.removeprefix(PACKAGE).partition(".")
        return renamed.get(PACKAGE + top, PACKAGE + top) + dot + nested

    new_messages = _messages(new)
    for name, message in _messages(old).items():
        fields_now = {field.number: field for field in new_messages[now_named(name)].field}
        for field in message.field:
            expected = descriptor_pb2.FieldDescriptorProto()
            expected.CopyFrom(field)
            if field.type_name:
                expected.type_name = now_named(field.type_name)
            assert fields_now.get(field.number) == expected, f"{name}.{field.name}"
    new_enums = {enum.name: enum for file in new.file for enum in file.enum_type}
    for enum in [enum for file in old.file for enum in file.enum_type]:
        assert all(value in new_enums[enum.name].value for value in enum.value), enum.name
    assert sum(then != now for then, now in renamed.items()) == 60  # the requests and responses renamed


def call_services(spec: dict, stubs_path: Path | None = None) -> dict:
    """wire_calls.py in a process of its own, with the stubs under `stubs_path` first on its path (None: today's)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if stubs_path is not None:
        env["PYTHONPATH"] = str(stubs_path)
    done = subprocess.run([sys.executable, str(WIRE_CALLS), json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def stubs_of_then(tmp_path_factory) -> Path:
    """The `rlfabric.v1` stubs generated from the protos before the renames, alone in a folder."""
    root = tmp_path_factory.mktemp("stubs-of-then")
    generate(root / "rlfabric" / "v1", proto_root=checkout("protos", root / "source"))
    (root / "rlfabric" / "__init__.py").write_text("")
    assert not (root / "rlfabric" / "v1" / "common_pb2.py").exists()
    return root


@pytest.fixture(scope="module")
def servers_of_now(tiny_model, tmp_path_factory):
    """Every role's service of today on loopback in this process (as tests/coordinator/meshes.over_grpc serves
    them), the coordinator's run over them; their addresses and the storage root."""
    run_dir = tmp_path_factory.mktemp("wire") / "run"
    config = fast_config(tiny_model, "actor.use_kl_loss=true", "algorithm.adv_estimator=gae")
    prepare_run_dir(config, run_dir)
    servers: dict[str, ServerThread] = {}
    try:
        for role in ("actor", "reference", "critic", "rollout", "reward", "env", "coordinator"):
            servers[role] = ServerThread(build_service(role, config), ServerOptions(port=0, metrics_port=None))
            if role not in ("env", "coordinator"):
                getattr(config.cluster, role).append(servers[role].address)
        yield {role: server.address for role, server in servers.items()}, run_dir.parent
    finally:
        for server in reversed(servers.values()):
            server.stop()


@pytest.fixture(scope="module")
def servers_of_then(tmp_path_factory):
    """The reward and environment services as the code before the renames serves them (`python -m rlfabric serve`
    of a checkout of services/ at that commit); their addresses."""
    root = tmp_path_factory.mktemp("code-of-then")
    checkout("services", root).rename(root / "rlfabric")
    assert not (root / "rlfabric" / "v1" / "common_pb2.py").exists()
    (root / "config.yaml").write_text("{}\n")
    env = {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, "PYTHONPATH": str(root)}
    processes, addresses = [], {}
    try:
        for role in ("reward", "env"):
            port_file = root / f"{role}.ports.json"
            process = subprocess.Popen(
                [sys.executable, "-m", "rlfabric", "serve", role, "--config", str(root / "config.yaml"), "--port", "0",
                 "--metrics-port", "0", "--port-file", str(port_file)], cwd=root, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            processes.append(process)
            wait_until(lambda f=port_file, p=process: f.exists() or p.poll() is not None, 120, f"the {role} service")
            assert process.poll() is None, f"rlfabric serve {role} of then exited {process.returncode}"
            addresses[role] = f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"
        yield addresses
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


def check_reward(results: dict) -> None:
    assert [r.get("score", 0.0) for r in results["scored"]["results"]] == [1.0, 0.0]
    assert all(r["status"] == "SCORE_STATUS_OK" for r in results["scored"]["results"])
    assert "openai/gsm8k" in results["status"]["data_sources"]


def check_environment(results: dict) -> None:
    assert results["reset"]["session_id"] and [t["name"] for t in results["reset"]["tools"]] == ["calculator"]
    assert results["tool"]["observation"]["messages"] == [{"role": "tool", "content": "42"}]
    assert results["tool"]["status"] == "STEP_STATUS_OK" and not results["tool"].get("done")
    assert results["final"]["done"] is True and results["final"]["reward"] == 1.0  # "#### 42" is the answer
    assert int(results["status"]["steps"]) >= 2


@pytest.mark.slow
def test_stubs_of_then_call_the_servers_of_now(servers_of_now, stubs_of_then):
    addresses, storage_root = servers_of_now
    answer = call_services({"addresses": addresses, "work_dir": str(storage_root / "wire"),
                            "scenarios": ["coordinator", "model_roles", "rollout", "reward", "environment"]},
                           stubs_of_then)
    types = answer["types"]  # the names of then: the calls went through the old stubs
    assert ["ScoreRequest", "ScoreResponse"] in types["RewardService"]
    assert ["ComputeLogProbsRequest", "ComputeLogProbsResponse"] in types["ActorService"]
    assert sum(len(pairs) for pairs in types.values()) == 41  # every RPC of the seven services (42) but PushWeights
    results = answer["results"]

    run = results["coordinator"]
    assert "state" not in run["before"] and run["started"]["run_id"]  # RUN_STATE_UNSPECIFIED: no run yet
    assert int(run["checkpoint"]["step"]) >= 1 and run["checkpoint"]["path"].endswith(run["checkpoint"]["step"])
    assert run["after"]["state"] == "RUN_STATE_STOPPED" and int(run["after"]["step"]) >= 1
    assert [int(m["step"]) for m in run["metrics"]] == list(range(1, int(run["after"]["step"]) + 1))
    assert all("critic/vf_loss" in m["metrics"] for m in run["metrics"])

    roles = results["model_roles"]
    for outputs, name in ((roles["actor_log_probs"], "log_probs"), (roles["reference_log_probs"], "log_probs"),
                          (roles["values"], "values")):
        assert outputs["outputs"]["tensors"][name]["shape"] == ["32", "4"]
    assert "actor/pg_loss" in roles["actor_update"]["metrics"] and "critic/vf_loss" in roles["critic_update"]["metrics"]
    for saved in ("actor_saved", "critic_saved", "actor_exported"):
        assert int(roles[saved]["num_bytes"]) > 0
    assert roles["actor_loaded"]["optimizer_step"] == roles["actor_status"]["optimizer_step"]
    assert roles["critic_loaded"]["optimizer_step"] == roles["critic_status"]["optimizer_step"]
    sync = roles["sync"]
    version = sync["rollout"]["version"]
    assert int(sync["sent"]["num_bytes"]) > 0 and sync["reference"]["version"] == version
    assert roles["reference_status"]["weight_version"] == version

    rollout = results["rollout"]
    for samples in (rollout["generated"]["samples"], [r["sample"] for r in rollout["streamed"]]):
        assert sorted(s.get("sample_index", 0) for s in samples) == [0, 1]
        assert all(0 < len(s["token_ids"]) <= 4 and len(s["logprobs"]) == len(s["token_ids"]) for s in samples)
    assert rollout["status"]["weight_version"] == version and not rollout["status"].get("paused")

    check_reward(results["reward"])
    check_environment(results["environment"])


@pytest.mark.slow
def test_stubs_of_now_call_the_servers_of_then(servers_of_then):
    answer = call_services({"addresses": servers_of_then, "work_dir": "", "scenarios": ["reward", "environment"]})
    assert answer["types"]["RewardService"] == [["RewardServiceScoreRequest", "RewardServiceScoreResponse"],
                                                ["RewardServiceGetStatusRequest", "RewardServiceGetStatusResponse"]]
    assert ["EnvironmentServiceStepRequest", "EnvironmentServiceStepResponse"] in answer["types"]["EnvironmentService"]
    check_reward(answer["results"]["reward"])
    check_environment(answer["results"]["environment"])
