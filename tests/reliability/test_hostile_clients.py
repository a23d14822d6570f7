"""A client that holds the token and means harm, or one without it, against real services.

Each attack asserts the refusal (its status code and a message naming what protects) and that nothing on
disk changed. The storage root is one folder; "the user's" files lie beside it and inside it:
1. Paths: absolute paths, `..` traversal and a symlink out of the root are PERMISSION_DENIED naming the
   root, for ExportHF, SaveCheckpoint and LoadCheckpoint, and for StartRun's data files and resume path;
   a folder inside the root that is not an rlfabric export or checkpoint is FAILED_PRECONDITION.
2. StartRun cannot set trainer.run_dir (INVALID_ARGUMENT), so one run cannot write into another's folder.
3. Without the token: UNAUTHENTICATED, nothing written, and a 128 MiB request is refused unread (the
   server's peak memory is measured).
4. `rlfabric serve` on a non-loopback address without TLS and a token refuses to start.
Elsewhere: two StartRuns at once (tests/test_local_mesh.py), weight-sync group exhaustion, scoring a
client gave up on, hung in-process scorers (test_bounded_resources.py), escapes from the reward sandbox
(tests/reward/test_sandbox.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from rlfabric.core.config import config_from_dict
from rlfabric.core.server import ServerOptions
from rlfabric.serve import build_service
from rlfabric.serve import build_service as build_trainer_service
from rlfabric.v1 import (
    actor_pb2,
    actor_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
)
from tests.reliability.helpers import trainer_config

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
    return actor.ExportHF(actor_pb2.ExportHFRequest(path=path), timeout=120, metadata=metadata)


def save(actor, path: str):
    request = actor_pb2.SaveCheckpointRequest()
    request.location.path = path
    return actor.SaveCheckpoint(request, timeout=120, metadata=BEARER)


def load(actor, path: str):
    request = actor_pb2.LoadCheckpointRequest()
    request.location.path = path
    return actor.LoadCheckpoint(request, timeout=120, metadata=BEARER)


def start_run(coordinator, override: str):
    return coordinator.StartRun(coordinator_pb2.StartRunRequest(overrides=[override]), timeout=60, metadata=BEARER)


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
    status = coordinator.GetRunStatus(coordinator_pb2.GetRunStatusRequest(), timeout=10, metadata=BEARER)
    assert status.state == coordinator_pb2.RUN_STATE_UNSPECIFIED  # nothing started
    assert snapshot(disk["base"]) == before


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
            request = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response="x" * (128 << 20))])
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
