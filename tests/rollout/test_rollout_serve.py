"""Smoke test of the real entry point: `python -m rlfabric serve rollout` (hf engine) becomes ready,
generates through the typed client, reports its status, and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest

from rlfabric.core.client import wait_until_serving
from rlfabric.rollout.client import RolloutClient
from rlfabric.rollout.types import Finish, SamplingSpec

pytestmark = pytest.mark.slow


def test_serve_rollout_generates_and_stops_on_sigterm(tmp_path, tiny_model):
    port_file = tmp_path / "ports.json"
    # Overrides go right after the role: argparse does not take positionals after the options.
    command = [sys.executable, "-m", "rlfabric", "serve", "rollout", f"model.path={tiny_model}", "rollout.engine=hf",
               "--port", "0", "--metrics-port", "0", "--port-file", str(port_file)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert process.poll() is None, f"serve exited {process.returncode}: {process.stdout.read()}"
            assert time.monotonic() < deadline, "no port file within 60 s"
            time.sleep(0.05)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"

        async def talk():
            await wait_until_serving(address, timeout_s=60)
            async with RolloutClient(address) as rollout:
                samples = await rollout.generate([[{"role": "user", "content": "hi"}], [5, 6]],
                                                 SamplingSpec(n=2, max_tokens=5, seed=0))
                streamed = [s async for s in rollout.generate_stream([[5, 6]], SamplingSpec(n=3, max_tokens=5))]
                return samples, streamed, await rollout.status()

        samples, streamed, status = asyncio.run(talk())
        assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(s.finish_reason in (Finish.STOP, Finish.LENGTH) and len(s.logprobs) == len(s.token_ids)
                   for s in samples)
        assert sorted(s.sample_index for s in streamed) == [0, 1, 2]
        assert (status.engine, status.model, status.weight_version) == ("hf", str(tiny_model), 0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
