"""A client that holds the token and means harm, or one without it, against real services.

Each attack asserts the refusal (its status code and a message naming what protects) and that nothing on
disk changed. The storage root is one folder; "the user's" files lie beside it and inside it:
1. Paths: absolute paths, `..` traversal and a symlink out of the root are PERMISSION_DENIED naming the
   root, for ExportHF, SaveCheckpoint and LoadCheckpoint, and for StartRun's data files and resume path;
   a folder inside the root that is not an rlfabric export or checkpoint is FAILED_PRECONDITION.
2. StartRun cannot set trainer.run_dir (INVALID_ARGUMENT), so one run cannot write into another's folder,
   however the key is spelt (decided on the parsed key and on what the overrides changed); every key that
   names a file or an address is confined to the root or refused (trainer.mlflow.tracking_uri among them);
   YAML aliases are refused, and error details and their log lines stay a few KiB whatever they quote.
   A NUL byte in a path is INVALID_ARGUMENT, a full disk (a tmpfs in the root) RESOURCE_EXHAUSTED.
   A Generate cannot make a rollout replica call an environment address its own config does not name.
3. Without the token: UNAUTHENTICATED, nothing written, and a 128 MiB request is refused unread (the
   server's peak memory is measured).
4. `rlfabric serve` on a non-loopback address without TLS and a token refuses to start.
Elsewhere: two StartRuns at once (tests/launch/test_local_mesh.py), weight-sync group exhaustion, scoring a
client gave up on, hung in-process scorers (test_bounded_resources.py), escapes from the reward sandbox
(tests/sandbox/test_reward_sandbox.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from rlfabric.core.config import config_from_dict, config_reference
from rlfabric.core.server import ServerOptions
from rlfabric.serve import build_service
from rlfabric.serve import build_service as build_trainer_service
from rlfabric.v1 import (
    actor_pb2,
    actor_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
)
from tests.conftest import ServerThread
from tests.reliability.helpers import trainer_config

pytestmark = pytest.mark.slow

TOKEN = "hostile-clients-test-token-0123456789abcdef"
BEARER = (("authorization", f"Bearer {TOKEN}"),)


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under folder: a file's sha256, a link's target, or "dir"."""
    entries = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            entries[key] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            entries[key] = "dir"
        else:
            entries[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """The storage root and a user's folder outside it, with files that must survive every attack."""
    base = tmp_path_factory.mktemp("hostile")
    root, home = base / "runs", base / "home"
    (home / "projects").mkdir(parents=True)
    (home / "projects" / "thesis.tex").write_text("years of work")
    (root / "notes").mkdir(parents=True)  # the user's own folder, inside the root
    (root / "notes" / "todo.txt").write_text("buy milk")
    (root / "escape").symlink_to(home / "projects", target_is_directory=True)
    token_file = base / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    return {"base": base, "root": root, "home": home, "token": token_file}


@pytest.fixture(scope="module")
def actor(serve_module, tiny_model, disk):
    config = trainer_config(tiny_model, storage={"root": str(disk["root"])},
                            server={"auth_token_file": str(disk["token"])})
    server = serve_module(build_trainer_service("actor", config),
                          ServerOptions.from_config(config.server, port=0, metrics_port=None))
    with grpc.insecure_channel(server.address) as channel:
        yield actor_pb2_grpc.ActorServiceStub(channel)


@pytest.fixture(scope="module")
def coordinator(serve_module, tiny_model, disk):
    """A coordinator whose StartRun refuses before it would reach any peer."""
    config = config_from_dict({"model": {"path": str(tiny_model)},
                               "trainer": {"run_dir": str(disk["root"] / "mesh")},
                               "storage": {"root": str(disk["root"])},
                               "server": {"auth_token_file": str(disk["token"])}})
    server = serve_module(build_service("coordinator", config),
                          ServerOptions.from_config(config.server, port=0, metrics_port=None))
    with grpc.insecure_channel(server.address) as channel:
        yield coordinator_pb2_grpc.CoordinatorServiceStub(channel)


def export(actor, path: str, metadata=BEARER):
    return actor.ExportHF(actor_pb2.ActorServiceExportHFRequest(path=path), timeout=120, metadata=metadata)


def save(actor, path: str):
    request = actor_pb2.ActorServiceSaveCheckpointRequest()
    request.location.path = path
    return actor.SaveCheckpoint(request, timeout=120, metadata=BEARER)


def load(actor, path: str):
    request = actor_pb2.ActorServiceLoadCheckpointRequest()
    request.location.path = path
    return actor.LoadCheckpoint(request, timeout=120, metadata=BEARER)


def start_run(coordinator, override: str):
    request = coordinator_pb2.CoordinatorServiceStartRunRequest(overrides=[override])
    return coordinator.StartRun(request, timeout=60, metadata=BEARER)


def refusal(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call(*args, **kwargs)
    return refused.value


# --- 1. paths ---------------------------------------------------------------------------------------


def test_paths_out_of_the_storage_root_are_refused_and_nothing_changes(actor, disk):
    root, home = disk["root"], disk["home"]
    before = snapshot(disk["base"])
    escapes = [
        str(home / "projects"),  # absolute, outside
        "../home/projects",  # traversal from the root
        "notes/../../home/projects",
        "escape",  # a symlink inside the root that points out of it
        "escape/new-folder",
        str(root / "escape" / "thesis.tex"),
    ]
    for path in escapes:
        for rpc in (export, save, load):
            error = refusal(rpc, actor, path)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (rpc.__name__, path, error.details())
            assert f"outside the storage root {root.resolve()}" in error.details(), error.details()
    assert snapshot(disk["base"]) == before


def test_a_folder_the_user_made_inside_the_root_is_never_replaced(actor, disk):
    before = snapshot(disk["base"])
    for rpc in (export, save):
        error = refusal(rpc, actor, "notes")
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert "notes" in error.details()
    assert snapshot(disk["base"]) == before


def test_writes_inside_the_root_still_work_relative_paths_included(actor, disk):
    assert export(actor, "exports/policy").num_bytes > 0
    assert (disk["root"] / "exports" / "policy" / "config.json").exists()
    assert save(actor, str(disk["root"] / "checkpoints" / "one")).num_bytes > 0
    assert load(actor, "checkpoints/one").optimizer_step == 0


def test_start_run_cannot_pick_the_run_dir_nor_read_outside_the_root(coordinator, disk):
    home = disk["home"]
    (home / "data.parquet").write_bytes(b"PAR1")
    (disk["root"] / "data-link.parquet").symlink_to(home / "data.parquet")
    before = snapshot(disk["base"])
    attacks = {
        f"trainer.run_dir={disk['root'] / 'someone-elses-run'}": grpc.StatusCode.INVALID_ARGUMENT,
        f"trainer.run_dir={home}": grpc.StatusCode.INVALID_ARGUMENT,
        f"trainer.resume_from_path={home / 'projects'}": grpc.StatusCode.PERMISSION_DENIED,
        "trainer.resume_from_path=../home/projects": grpc.StatusCode.PERMISSION_DENIED,
        f"data.train_files=[{home / 'data.parquet'}]": grpc.StatusCode.PERMISSION_DENIED,
        "data.train_files=[data-link.parquet]": grpc.StatusCode.PERMISSION_DENIED,
        f"data.val_files=[{home / 'data.parquet'}]": grpc.StatusCode.PERMISSION_DENIED,
        "trainer.experiment_name=../escape": grpc.StatusCode.INVALID_ARGUMENT,
    }
    for override, code in attacks.items():
        error = refusal(start_run, coordinator, override)
        assert error.code() == code, (override, error.details())
        if code == grpc.StatusCode.PERMISSION_DENIED:
            assert "storage.root" in error.details()
    # The refusal says what to use instead.
    assert "trainer.experiment_name" in refusal(start_run, coordinator, f"trainer.run_dir={home}").details()
    status = coordinator.GetRunStatus(coordinator_pb2.CoordinatorServiceGetRunStatusRequest(), timeout=10,
                                      metadata=BEARER)
    assert status.state == coordinator_pb2.RUN_STATE_UNSPECIFIED  # nothing started
    assert snapshot(disk["base"]) == before


# --- 2. StartRun's overrides: decided on the parsed key, on what they change, without amplification ---


def test_start_run_decides_on_the_parsed_key_not_the_raw_text(coordinator, disk):
    """A guard on the raw text let "trainer.run_dir =/elsewhere" through (the key was stripped after it):
    that run wrote outside the root and truncated the folder's metrics.jsonl. Every spelling is refused."""
    elsewhere = disk["home"] / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    (elsewhere / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    before = snapshot(disk["base"])
    spellings = {  # override -> what the refusal names
        f"trainer.run_dir ={elsewhere}": "trainer.run_dir",
        f"trainer.run_dir\t={elsewhere}": "trainer.run_dir",
        f" trainer.run_dir = {elsewhere}": "trainer.run_dir",
        f"trainer={{run_dir: {elsewhere}}}": "trainer.run_dir",  # the whole section at once
        f"trainer . run_dir={elsewhere}": "not a dotted key",
        f"trainer..run_dir={elsewhere}": "not a dotted key",
        f"trainer.run_dir\u200b={elsewhere}": "not a dotted key",  # a zero-width space
        f"\uff54rainer.run_dir={elsewhere}": "not a dotted key",  # a fullwidth t
        f"trainer.mlflow={{tracking_uri: 'sqlite:///{elsewhere}/mlflow.db'}}": "trainer.mlflow.tracking_uri",
        "rollout={multi_turn: {env_address: '127.0.0.1:1'}}": "rollout.multi_turn.env_address",
    }
    for override, named in spellings.items():
        error = refusal(start_run, coordinator, override)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (override, error.code(), error.details())
        assert named in error.details(), (override, error.details())
    assert snapshot(disk["base"]) == before  # metrics.jsonl elsewhere untouched, nothing new anywhere


# Keys that name a file, a folder, an address or code to import (by their last part; cluster.* are addresses).
NAMES_A_PLACE = re.compile(r"(path|files?|dir|uri|url|address(es)?|endpoint|root|host|modules)$")
CONFINED = ("data.train_files", "data.val_files", "trainer.resume_from_path")  # resolved under storage.root


def test_every_key_naming_a_file_or_an_address_is_confined_or_refused(coordinator, disk):
    """The audit of issue 35: a StartRun that names a path or an address either stays inside the storage
    root (PERMISSION_DENIED outside it) or is refused (only the mesh's own config sets the key). A key added
    later that names a place fails this test until it is one or the other."""
    outside = disk["home"] / "projects"
    keys = [(key, default) for key, default, _ in config_reference()
            if key.startswith("cluster.") or NAMES_A_PLACE.search(key.rsplit(".", 1)[-1])]
    assert len(keys) > 25, keys
    before = snapshot(disk["base"])
    for key, default in keys:
        value = f"[{outside}]" if default.startswith("[") else str(outside)
        error = refusal(start_run, coordinator, f"{key}={value}")
        expected = (grpc.StatusCode.PERMISSION_DENIED if key in CONFINED or key == "algorithm.plugin_modules"
                    else grpc.StatusCode.INVALID_ARGUMENT)
        assert error.code() == expected, (key, error.code(), error.details())
        assert key in error.details(), (key, error.details())
    assert snapshot(disk["base"]) == before


def test_start_run_cannot_make_the_coordinator_call_an_address_or_write_a_store(coordinator, disk):
    """trainer.mlflow.tracking_uri: a sqlite file outside the root was created; an http:// URI made the
    coordinator send requests wherever the caller chose. Only the mesh's own config sets it now."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    before = snapshot(disk["base"])
    try:
        for uri in (f"sqlite:///{disk['home'] / 'mlflow.db'}", f"http://127.0.0.1:{port}", "file:///tmp/mlruns"):
            error = refusal(coordinator.StartRun, coordinator_pb2.CoordinatorServiceStartRunRequest(
                overrides=["trainer.loggers=[jsonl,mlflow]", f"trainer.mlflow.tracking_uri={uri}"]),
                timeout=60, metadata=BEARER)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (uri, error.details())
            assert "trainer.mlflow.tracking_uri" in error.details() and "mesh's own config" in error.details()
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody called
    finally:
        listener.close()
    assert snapshot(disk["base"]) == before


class RecordingServer(grpc.GenericRpcHandler):
    """A gRPC server on loopback, standing for any service a pod reaches, that records every call it gets
    (method and metadata) and implements none."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.calls: list[tuple[str, dict]] = []
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2), handlers=[self])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, handler_call_details):
        self.calls.append((handler_call_details.method, dict(handler_call_details.invocation_metadata)))
        return None  # UNIMPLEMENTED

    def stop(self) -> None:
        self.server.stop(0)


def multi_turn_request(env_address: str):
    from rlfabric.rollout import wire
    from rlfabric.rollout.types import AgentPrompt, AgentTask, MultiTurnSpec, SamplingSpec
    from rlfabric.v1 import rollout_pb2

    prompt = AgentPrompt([{"role": "user", "content": "What is 6*7?"}], AgentTask("calculator", "42"))
    spec = SamplingSpec(n=2, max_tokens=8, seed=3, multi_turn=MultiTurnSpec(
        env_address=env_address, max_turns=2, max_total_tokens=64, env_timeout_s=5.0))
    return rollout_pb2.RolloutServiceGenerateRequest(prompts=[wire.prompt_to_proto(prompt)],
                                                     sampling_params=wire.sampling_to_proto(spec))


def test_a_generate_cannot_make_a_rollout_replica_call_an_address_of_its_choosing(tiny_model, disk, tmp_path):
    """multi_turn.env_address made a replica connect, with the environment's token, to any host:port a caller
    named (in a cluster, any address its pod reaches), keeping a channel per address. A replica calls only
    the environments its own config names: any other is PERMISSION_DENIED, nothing connects there, and the
    replica goes on with its own environment (named or not)."""
    from rlfabric.v1 import rollout_pb2_grpc

    env_token = tmp_path / "env_token"
    env_token.write_text("the-environment-link-token-0123456789")
    env_token.chmod(0o600)
    env = ServerThread(build_service("env", config_from_dict({})), ServerOptions(port=0, metrics_port=None))
    victim, listener = RecordingServer(), socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    config = config_from_dict({"model": {"path": str(tiny_model)}, "server": {"auth_token_file": str(disk["token"])},
                               "env": {"auth_token_file": str(env_token)},
                               "rollout": {"multi_turn": {"enable": True, "env_address": env.address}}})
    replica = ServerThread(build_service("rollout", config),
                           ServerOptions.from_config(config.server, port=0, metrics_port=None))
    hostile = [victim.address, f"127.0.0.1:{listener.getsockname()[1]}",
               f"localhost:{env.server.port}"]  # its own environment spelt otherwise: compared as written
    try:
        with grpc.insecure_channel(replica.address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            for address in hostile:
                error = refusal(stub.Generate, multi_turn_request(address), timeout=60, metadata=BEARER)
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (address, error.code(), error.details())
                assert address in error.details() and "rollout.multi_turn.allowed_env_addresses" in error.details()
            for address in ("", env.address):
                samples = stub.Generate(multi_turn_request(address), timeout=60, metadata=BEARER).samples
                assert len(samples) == 2 and {s.agent_status for s in samples} <= {"done", "max_turns", "max_tokens"}
        assert victim.calls == []
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
        agents = replica.server.service.bindings[0].servicer.agents
        assert list(agents._env_clients) == [env.address]  # bounded by its config
    finally:
        replica.stop()
        env.stop()
        victim.stop()
        listener.close()


def test_yaml_aliases_in_an_override_are_refused_without_amplification(coordinator, caplog):
    """A ~300-byte override whose aliases nest copies of copies ("billion laughs") gave a 28 MB error
    message and 27 MiB of log. Aliases and anchors are refused; the error and the log stay small."""
    levels = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for name, below in zip("bcdef", "abcde", strict=True):
        levels.append(f"{name}: &{name} [{', '.join([f'*{below}'] * 9)}]")
    override = f"trainer.project_name={{{', '.join(levels)}}}"
    assert len(override) < 400
    caplog.set_level(logging.INFO)
    caplog.clear()
    error = refusal(start_run, coordinator, override)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()[:500]
    assert "trainer.project_name" in error.details() and "aliases" in error.details()
    assert len(error.details()) < 2000, len(error.details())
    logged = sum(len(record.getMessage()) + len(str(getattr(record, "fields", ""))) for record in caplog.records)
    assert logged < 8192, logged


def test_error_details_and_their_log_lines_are_capped(actor, coordinator, caplog):
    """Whatever a message quotes (here a 1 MiB path, a 1 MiB value) the client gets a few KiB that still
    say what was wrong, and so does the log; the service keeps serving."""
    caplog.set_level(logging.INFO)
    caplog.clear()
    error = refusal(export, actor, "../" + "x" * (1 << 20))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert len(error.details()) <= 4096 and "outside the storage root" in error.details(), len(error.details())
    error = refusal(start_run, coordinator, f"trainer.total_steps={'9' * (1 << 20)}x")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(error.details()) <= 4096 and "trainer.total_steps" in error.details(), len(error.details())
    logged = max(len(record.getMessage()) + len(str(getattr(record, "fields", ""))) for record in caplog.records)
    assert logged < 8192, logged
    assert export(actor, "exports/after-the-big-ones").num_bytes > 0


# --- 9. the right status code, naming the cause --------------------------------------------------------


def test_a_nul_byte_in_a_path_is_invalid_argument_naming_the_field(actor, coordinator, disk):
    before = snapshot(disk["base"])
    for rpc, field in ((export, "export path"), (save, "checkpoint path"), (load, "checkpoint path")):
        error = refusal(rpc, actor, "exports/a\x00b")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc.__name__, error.code(), error.details())
        assert field in error.details() and "NUL" in error.details(), error.details()
    for override in ('data.train_files=["a\\0b.parquet"]', 'trainer.resume_from_path="a\\0b"'):
        error = refusal(start_run, coordinator, override)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (override, error.code(), error.details())
        assert override.split("=")[0] in error.details() and "NUL" in error.details(), error.details()
    assert snapshot(disk["base"]) == before


@pytest.fixture
def full_disk(disk):
    """A folder of the storage root on a 128 KiB tmpfs of its own: a disk too small for any export."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (run as root to test a full disk)")
    where = disk["root"] / "small-disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
        where.rmdir()


def test_a_full_disk_is_resource_exhausted_saying_so_and_leaves_nothing_behind(actor, full_disk):
    """ExportHF and SaveCheckpoint onto a full disk answered INTERNAL with safetensors' or torch's message
    (torch's, "unexpected pos 576 vs 534", does not say the disk is full)."""
    for rpc, path in ((export, "small-disk/policy"), (save, "small-disk/checkpoint")):
        error = refusal(rpc, actor, path)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (rpc.__name__, error.code(), error.details())
        assert "disk" in error.details() and "full" in error.details(), error.details()
        assert str(full_disk / path.split("/")[1]) in error.details(), error.details()
        assert os.listdir(full_disk) == []  # the partial write is gone
    assert export(actor, "exports/after-a-full-disk").num_bytes > 0


def test_a_writer_whose_error_does_not_say_the_disk_is_full_is_still_reported_so(full_disk):
    """torch.save on a full disk raises RuntimeError("... unexpected pos ..."): the free space tells."""
    import torch

    from rlfabric.core.errors import ResourceExhausted
    from rlfabric.trainer.checkpoint import write_atomically

    def write(directory: Path) -> None:
        torch.save(torch.zeros(1 << 16), directory / "state.pt")  # 256 KiB

    with pytest.raises(ResourceExhausted, match=r"cannot write .*small-disk/state: the disk holding it is full"):
        write_atomically(str(full_disk / "state"), write, replaceable=lambda _: False)
    assert os.listdir(full_disk) == []


# --- 3. without the token -----------------------------------------------------------------------------


def test_without_the_token_nothing_is_written(actor, disk):
    before = snapshot(disk["base"])
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        error = refusal(export, actor, "unauthenticated-export", metadata)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert snapshot(disk["base"]) == before


def _peak_rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


def test_an_oversized_unauthenticated_request_is_refused_unread(disk, tmp_path):
    """The reward service as `rlfabric serve` runs it; a 128 MiB Score without a token. Read before the
    refusal, it raised the server's peak memory by 3x its size; unread, by a few MiB."""
    port_file = tmp_path / "ports.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "serve", "reward", "--port", "0", "--metrics-port", "0",
         "--port-file", str(port_file), f"server.auth_token_file={disk['token']}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert server.poll() is None and time.monotonic() < deadline, "the reward service did not start"
            time.sleep(0.05)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"
        options = [("grpc.max_send_message_length", 512 << 20)]
        with grpc.insecure_channel(address, options=options) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            stub.GetStatus(reward_pb2.RewardServiceGetStatusRequest(), timeout=60, metadata=BEARER,
                           wait_for_ready=True)  # serving, its engine loaded
            before = _peak_rss_mib(server.pid)
            request = reward_pb2.RewardServiceScoreRequest(items=[reward_pb2.ScoreItem(response="x" * (128 << 20))])
            started = time.monotonic()
            error = refusal(stub.Score, request, timeout=60)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() - started < 10
            grown = _peak_rss_mib(server.pid) - before
            assert grown < 32, f"the server's peak memory grew by {grown} MiB for a refused request"
            # It still serves callers with the token.
            assert stub.GetStatus(reward_pb2.RewardServiceGetStatusRequest(), timeout=10, metadata=BEARER)
    finally:
        server.terminate()
        server.wait(30)


# --- 4. exposure ------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["server.auth_token_file={token}"]], ids=["no-token", "token-no-tls"])
def test_serving_beyond_loopback_without_tls_and_a_token_is_refused(disk, extra):
    done = subprocess.run(
        [sys.executable, "-m", "rlfabric", "serve", "reward", "--host", "0.0.0.0", "--port", "0",
         "--metrics-port", "0", *(e.format(token=disk["token"]) for e in extra)],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "refusing to serve on 0.0.0.0" in done.stderr and "server.allow_insecure" in done.stderr


def test_allow_insecure_is_the_explicit_way_to_serve_plaintext_beyond_loopback(tmp_path):
    port_file = tmp_path / "ports.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "serve", "reward", "--host", "0.0.0.0", "--port", "0",
         "--metrics-port", "0", "--port-file", str(port_file), "server.allow_insecure=true"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert server.poll() is None, "serve exited although server.allow_insecure was set"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.terminate()
        server.wait(30)


# --- 6. weight sync: a stuck group never blocks the next one -------------------------------------------


@pytest.fixture(scope="module")
def sync_mesh(tiny_model):
    """An actor and one hf rollout replica (gloo), real gRPC servers on loopback, no token."""
    from tests.weight_sync.helpers import Mesh, mesh_config

    # A short cap: the hostile joins' rendezvous threads, which nothing can interrupt, end soon after the test.
    config = mesh_config(tiny_model, "weight_sync.transport=gloo", "weight_sync.max_timeout_s=20")
    mesh = Mesh(config, {"r0": config})
    yield mesh
    mesh.stop()


def hostile_join(address: str, timeout_s: float, store_port: int, deadline_s: float | None):
    """JoinWeightSyncGroup as rank 1 of a gloo group whose store (`store_port`) never answers."""
    from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc, weight_sync_pb2

    group = weight_sync_pb2.WeightSyncGroup(group_id="ws-hostile", transport=weight_sync_pb2.WEIGHT_TRANSPORT_GLOO,
                                            world_size=2, store_host="127.0.0.1", store_port=store_port,
                                            timeout_s=timeout_s)
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.JoinWeightSyncGroup(rollout_pb2.RolloutServiceJoinWeightSyncGroupRequest(group=group, rank=1),
                                        timeout=deadline_s)


def test_a_weight_sync_join_that_never_completes_does_not_block_the_next_group(sync_mesh):
    """A join with an absurd timeout is refused; one within weight_sync.max_timeout_s whose sender never
    comes is abandoned (by its caller's deadline, or by the next group) and a real sync from the actor
    works at once, in the same replica, without a restart."""
    import concurrent.futures
    import socket

    from tests.weight_sync.test_sync_services import rollout_version

    mesh = sync_mesh
    address = mesh.addresses["r0"]
    membership = mesh.rollouts["r0"].server.service.engine.weight_sync
    max_timeout_s = mesh.config.weight_sync.max_timeout_s
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never answers: a sender that never comes
        port = silent.getsockname()[1]
        for absurd in (1e9, float("inf"), max_timeout_s * 2):
            error = refusal(hostile_join, address, absurd, port, 10)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert "weight_sync.max_timeout_s" in error.details()
        # Within the cap: the caller gives up after a second; the rendezvous goes on on its thread.
        assert refusal(hostile_join, address, max_timeout_s, port, 1).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(refusal, hostile_join, address, max_timeout_s, port, None)  # no deadline at all
            deadline = time.monotonic() + 30
            while membership.joining is None:  # the replica is in the hostile rendezvous
                assert time.monotonic() < deadline and not waiting.done(), "the hostile join never started"
                time.sleep(0.01)
            plane = mesh.run(_plane(mesh))
            started = time.monotonic()
            assert mesh.run(plane.open()) == {}  # the real group replaces the stuck one
            error = waiting.result(30)
            assert error.code() == grpc.StatusCode.ABORTED, error.details()  # its caller hears why
            assert "joined another weight-sync group" in error.details()
        mesh.train_step(seed=3)
        report = mesh.run(plane.sync(1))
        assert report.failed == {}, report.failed
        assert time.monotonic() - started < 30
        assert rollout_version(address) == 1
        mesh.run(plane.close())


async def _plane(mesh):
    from rlfabric.coordinator.weight_sync import WeightSyncPlane

    return WeightSyncPlane(mesh.actor_client, mesh.addresses, mesh.config)


def test_an_absurd_weight_sync_group_size_is_invalid_argument_naming_the_field(sync_mesh):
    """Issue 35, item 9: num_receivers 2^31-1 was INTERNAL (torch's TCPStore takes no such world size)."""
    from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc, weight_sync_pb2

    with grpc.insecure_channel(sync_mesh.actor.address) as channel:
        stub = actor_pb2_grpc.ActorServiceStub(channel)
        for num_receivers in (2**31 - 1, 2**31 - 2, 1 << 20, -1):
            request = actor_pb2.ActorServiceOpenWeightSyncGroupRequest(
                transport=weight_sync_pb2.WEIGHT_TRANSPORT_GLOO, num_receivers=num_receivers)
            error = refusal(stub.OpenWeightSyncGroup, request, timeout=30)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (num_receivers, error.details())
            assert "num_receivers" in error.details()
    for world_size in (2**31 - 1, 1 << 20, 1):
        group = weight_sync_pb2.WeightSyncGroup(group_id="ws-big", transport=weight_sync_pb2.WEIGHT_TRANSPORT_GLOO,
                                                world_size=world_size, store_host="127.0.0.1", store_port=1,
                                                timeout_s=1)
        with grpc.insecure_channel(sync_mesh.addresses["r0"]) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            request = rollout_pb2.RolloutServiceJoinWeightSyncGroupRequest(group=group, rank=1)
            error = refusal(stub.JoinWeightSyncGroup, request, timeout=30)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (world_size, error.details())
        assert "world_size" in error.details()


# --- 7. refused big requests do not stay resident ------------------------------------------------------


class Served:
    """`rlfabric serve ROLE` in a process of its own (its RSS is its own), ready to serve."""

    def __init__(self, workdir: Path, role: str, *overrides: str):
        port_file = workdir / f"{role}.ports.json"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlfabric", "serve", role, "--port", "0", "--metrics-port", "0",
             "--port-file", str(port_file), *overrides], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert self.process.poll() is None and time.monotonic() < deadline, f"the {role} service did not start"
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"
        self.channel = grpc.insecure_channel(self.address, options=[("grpc.max_send_message_length", 512 << 20)])
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self.channel)
        ready = health_pb2.HealthCheckRequest(service="readiness")
        while health.Check(ready, timeout=60, wait_for_ready=True).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, f"the {role} service did not get ready"
            time.sleep(0.05)

    def rss_mib(self) -> int:
        import psutil

        return psutil.Process(self.process.pid).memory_info().rss >> 20

    def close(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(30)


# Under one refused request (100 MiB): the bugs kept every one (~170 MiB each). What does move is gRPC's and the
# allocator's high-water mark, freed heap the allocator keeps: over refused 100 MiB Steps on a quiet machine here,
# +23-39 MiB after 12 and a plateau of +50-56 MiB from the 10th to the 40th; +64 MiB after 4 once under make test's
# load.
RSS_BOUND_MIB = 96


def assert_stays_small(service: Served, attacks) -> None:
    """Four of each attack (a call with a ~100 MiB request) are refused with their code, and the
    service's resident memory ends within RSS_BOUND_MIB of where it stood after a first refusal of each (what
    the first call of a method allocates once, e.g. gRPC's buffers, is not what a refusal keeps)."""
    for call, request, code in attacks:
        assert refusal(call, request, timeout=120).code() == code
    before = service.rss_mib()
    for call, request, code in attacks:
        for _ in range(4):
            error = refusal(call, request, timeout=120)
            assert error.code() == code, error.details()
    deadline = time.monotonic() + 10  # a large refused request's memory is returned once its RPC has ended
    while (grown := service.rss_mib() - before) >= RSS_BOUND_MIB:
        assert time.monotonic() < deadline, f"RSS grew by {grown} MiB over refused requests"
        time.sleep(0.05)


def test_refused_large_steps_do_not_stay_resident_in_the_env_service(tmp_path):
    """Issue 35, item 7: 65 -> 734 MiB over four refused 100 MiB Steps. A Step needs kilobytes: the env
    service takes no request over server.max_control_message_kb, refused by gRPC before it is read."""
    from rlfabric.v1 import environment_pb2, environment_pb2_grpc

    service = Served(tmp_path, "env")
    try:
        stub = environment_pb2_grpc.EnvironmentServiceStub(service.channel)
        huge = environment_pb2.Action(text="x" * (100 << 20))
        step = environment_pb2.EnvironmentServiceStepRequest(session_id="s", action=huge)
        assert_stays_small(service, [(stub.Step, step, grpc.StatusCode.RESOURCE_EXHAUSTED)])
        assert stub.GetStatus(environment_pb2.EnvironmentServiceGetStatusRequest(), timeout=10).environments
    finally:
        service.close()


def test_refused_large_tensors_do_not_stay_resident_in_the_actor(tiny_model, tmp_path):
    """Issue 35, item 7: 489 -> 1205 MiB over four refused 100 MiB tensors. ComputeLogProbs takes batches,
    so a malformed 100 MiB one is parsed, then refused; it does not stay resident. (A method that takes
    no batch refuses one unparsed: tests/core/test_server.py.)"""
    import torch

    from rlfabric.core import codec

    service = Served(tmp_path, "actor", f"model.path={tiny_model}", f"storage.root={tmp_path}")
    try:
        stub = actor_pb2_grpc.ActorServiceStub(service.channel)
        batch = codec.encode_batch({"input_ids": torch.zeros(2, 3, dtype=torch.int64)})
        batch.tensors["input_ids"].raw_data = bytes(100 << 20)  # 100 MiB for 6 int64s
        malformed = actor_pb2.ActorServiceComputeLogProbsRequest(input=common_pb2.LogProbsInput(batch=batch))
        assert_stays_small(service, [(stub.ComputeLogProbs, malformed, grpc.StatusCode.INVALID_ARGUMENT)])
        assert stub.GetStatus(actor_pb2.ActorServiceGetStatusRequest(), timeout=10).num_parameters > 0
    finally:
        service.close()
