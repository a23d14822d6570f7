"""Weight sync into SGLang: a real actor and an hf rollout replica on loopback, and an SGLang replica whose
server is FakeSGLangServer (tests/rollout/fake_sglang.py, its own process: SGLang cannot run here) joining
the actor's group the way SGLang does. With rollout.engine sglang the actor opens a torch group over gloo;
the SGLang replica joins it through /init_weights_update_group and takes each dense bucket with
/update_weights_from_distributed, generation held around it; the hf replica joins the same group. (Each
rank of a torch group needs a process of its own, as every launcher but the in-process one gives them:
the hf replica runs as `rlfabric serve rollout`.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.client import wait_until_serving
from rlfabric.core.config import dump_config
from tests.numerics import ENGINE_LOGPROB_GAP
from tests.rollout.helpers import generate

from .helpers import Mesh, mesh_config
from .test_sync_services import rollout_version

pytestmark = pytest.mark.slow


class HfRolloutProcess:
    """`rlfabric serve rollout` (hf engine) in a process of its own."""

    def __init__(self, config, workdir):
        config_path, port_file = workdir / "hf.yaml", workdir / "hf.ports.json"
        dump_config(config, config_path)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlfabric", "serve", "rollout", "--config", str(config_path), "--port", "0",
             "--metrics-port", "0", "--port-file", str(port_file)],
            stdout=subprocess.DEVNULL, stderr=(workdir / "hf.log").open("ab"))
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert self.process.poll() is None and time.monotonic() < deadline, "the hf rollout did not start"
            time.sleep(0.1)
        self.address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


class FakeSGLangProcess:
    """`python -m tests.rollout.fake_sglang` in a process of its own."""

    def __init__(self, tmp_path):
        port_file = tmp_path / "fake-sglang.url"
        self.process = subprocess.Popen([sys.executable, "-m", "tests.rollout.fake_sglang", str(port_file)])
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert self.process.poll() is None and time.monotonic() < deadline, "the fake SGLang server did not start"
            time.sleep(0.05)
        self.url = port_file.read_text()

    def _call(self, path: str, payload=None):
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def calls(self, since: int = 0) -> list[tuple[str, dict]]:
        return [(path, body) for _, path, body in self._call("/fake/calls")[since:]]

    def weight(self, name: str, numel: int) -> torch.Tensor:
        return torch.tensor(self._call("/get_weights_by_name", {"name": name, "truncate_size": numel}))

    def fail_next_update(self, message: str) -> None:
        self._call("/fake/fail_next_update", {"message": message})

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


@pytest.fixture(scope="module")
def sglang_mesh(tiny_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sglang")
    fake = FakeSGLangProcess(workdir)
    config = mesh_config(tiny_model, "weight_sync.transport=gloo", "rollout.engine=sglang",
                         f"rollout.sglang_url={fake.url}")
    hf = HfRolloutProcess(mesh_config(tiny_model, "weight_sync.transport=gloo"), workdir)
    mesh = Mesh(config, {"sglang": config})
    mesh.run(wait_until_serving(hf.address, timeout_s=120), timeout=130)
    addresses = {**mesh.addresses, "hf": hf.address}
    plane = mesh.run(_plane(mesh, addresses))
    assert mesh.run(plane.open()) == {}
    yield mesh, plane, fake, addresses
    mesh.run(plane.close())
    mesh.stop()
    hf.stop()
    fake.stop()


async def _plane(mesh: Mesh, addresses: dict[str, str]) -> WeightSyncPlane:
    return WeightSyncPlane(mesh.actor_client, addresses, mesh.config)


def _actor_weights(mesh: Mesh) -> dict[str, torch.Tensor]:
    return mesh.run(mesh.actor.server.service.engine.gather_weights())


def test_sglang_joins_the_actors_torch_group_as_its_rank(sglang_mesh):
    mesh, plane, fake, addresses = sglang_mesh
    (join,) = [body for path, body in fake.calls() if path == "/init_weights_update_group"]
    assert join["backend"] == "gloo" and join["world_size"] == 3
    assert join["rank_offset"] == plane.ranks["sglang"] and join["group_name"].startswith("ws-")
    assert join["master_address"] == "127.0.0.1" and join["master_port"] > 0


def test_a_sync_updates_sglang_in_place_with_generation_held_and_the_version_set(sglang_mesh):
    mesh, plane, fake, addresses = sglang_mesh
    before = len(fake.calls())
    mesh.train_step(seed=21)
    report = mesh.run(plane.sync(1))
    assert report.ok, report.failed
    calls = fake.calls(before)
    paths = [path for path, _ in calls]
    updates = [body for path, body in calls if path == "/update_weights_from_distributed"]
    assert paths == ["/pause_generation", *["/update_weights_from_distributed"] * len(updates), "/continue_generation"]
    assert calls[0][1] == {"mode": "in_place"}
    assert all(u["load_format"] == "flattened_bucket" and u["weight_version"] == "1" for u in updates)
    assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
    # Every weight arrived intact: what the server holds is the actor's weights, bit for bit.
    actor = _actor_weights(mesh)
    names = [name for u in updates for name in u["names"]]
    assert set(names) <= set(actor) and len(names) >= len(actor) - 1  # a tied lm_head travels once
    for name in (names[0], names[len(names) // 2], names[-1]):
        assert torch.equal(fake.weight(name, actor[name].numel()), actor[name].flatten())
    assert rollout_version(addresses["sglang"]) == 1
    # The hf replica in the same torch group serves the same policy.
    assert rollout_version(addresses["hf"]) == 1 and mesh.logprob_gap(addresses["hf"]) <= ENGINE_LOGPROB_GAP


def test_a_failed_update_leaves_the_replica_on_its_version_until_the_group_is_rebuilt(sglang_mesh):
    mesh, plane, fake, addresses = sglang_mesh
    mesh.train_step(seed=22)
    fake.fail_next_update("load_weights: unexpected tensor")
    report = mesh.run(plane.sync(2))
    assert set(report.failed) == {"sglang"} and "unexpected tensor" in report.failed["sglang"]
    assert rollout_version(addresses["sglang"]) == 1 and rollout_version(addresses["hf"]) == 2
    with grpc.insecure_channel(addresses["sglang"]) as channel:  # the replica still serves
        assert len(generate(channel, [[5, 6]], max_tokens=2)) == 1
    before = len(fake.calls())
    report = mesh.run(plane.sync(3))
    assert report.ok, report.failed
    assert "/init_weights_update_group" in [path for path, _ in fake.calls(before)]  # it joined a new group
    assert rollout_version(addresses["sglang"]) == 3
    actor = _actor_weights(mesh)
    name = next(iter(actor))
    assert torch.equal(fake.weight(name, actor[name].numel()), actor[name].flatten())
