"""`rlfabric serve rollout --replicas 64` with the simulated engine: 64 replicas in one process, each on a port of
its own, become ready, answer GetStatus as the replica they are, serve a request spread over all of them by the
router, and the process exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from rlfabric.core.client import wait_until_serving
from rlfabric.rollout.client import RolloutClient
from rlfabric.rollout.router import RolloutRouter
from rlfabric.rollout.types import SamplingSpec
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
REPLICAS = 64


def test_sixty_four_sim_replicas_in_one_process_start_and_serve(tmp_path):
    ports = tmp_path / "ports"
    command = [sys.executable, "-m", "rlfabric", "serve", "rollout", "rollout.engine=sim", "sim.time_scale=0.001",
               f"rollout.replicas={REPLICAS}", "--port", "0", "--metrics-port", "0", "--replicas", str(REPLICAS),
               "--port-file", str(ports / "rollout-{replica}.json")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def all_bound():
            assert process.poll() is None, f"serve exited {process.returncode}: {process.stdout.read()}"
            return len(list(ports.glob("rollout-*.json"))) == REPLICAS

        wait_until(all_bound, 50, f"{REPLICAS} port files")
        files = [json.loads((ports / f"rollout-{i}.json").read_text()) for i in range(REPLICAS)]
        addresses = [f"127.0.0.1:{f['grpc']}" for f in files]

        async def talk():
            await asyncio.gather(*(wait_until_serving(address, timeout_s=30) for address in addresses))
            statuses = []
            for address in addresses:
                async with RolloutClient(address) as client:
                    statuses.append(await client.status())
            async with RolloutRouter(addresses) as router:
                prompts = [[i % 50 + 1, 2, 3] for i in range(REPLICAS * 2)]
                samples = await router.generate(prompts, SamplingSpec(n=2, max_tokens=16), chunk_prompts=2)
                served = [status.queue_depth for status in (await router.status()).values()]
            return statuses, samples, served

        statuses, samples, served = asyncio.run(talk())
        assert len({f["grpc"] for f in files}) == len({f["metrics"] for f in files}) == REPLICAS
        assert len({f["pid"] for f in files}) == 1  # one process
        assert [s.engine for s in statuses] == ["sim"] * REPLICAS
        assert sorted((s.prompt_index, s.sample_index) for s in samples) == \
            [(p, k) for p in range(REPLICAS * 2) for k in range(2)]
        assert served == [0] * REPLICAS  # every request answered, nothing left queued anywhere
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
