"""Two FSDP2 ranks (gloo on CPU, started by the service itself) train like one rank on the same batch."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlfabric.core.errors import FailedPrecondition
from tests.numerics import FLOAT64, assert_same_float32, assert_same_metric, assert_same_update
from tests.trainer.helpers import Served, make_batch, make_config

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # numerics: make test-kernels


def _train(served, batch, export_dir):
    old = served.run(served.client.compute_log_probs(batch, temperature=0.8))["log_probs"]
    advantages = torch.linspace(-1.0, 1.0, batch["responses"].numel()).reshape(batch["responses"].shape)
    metrics = []
    for step in range(2):
        update = {**batch, "old_log_probs": old, "advantages": advantages}
        metrics.append(served.run(served.client.update_policy(update, global_step=step)))
    served.run(served.client.export_hf(export_dir))
    return old, metrics, load_file(export_dir / "model.safetensors")


def test_two_ranks_match_one_rank(tiny_model, tmp_path):
    # 16 rows = 2 mini-batches of 4 prompts x n=2. Two ranks use a token budget instead of fixed
    # micro-batches, so they also exercise uneven plans that have to be equalised across ranks. In float64, so that
    # the bounds hold on every CPU's kernels (tests/numerics.py).
    common = {"lr": 1e-3, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "clip_ratio_high": 0.28}
    batch = make_batch(rows=16, prompt_len=8, response_len=6, seed=5)
    sampling = {"temperature": 0.8}
    with Served("actor", make_config(tiny_model, n=2, actor=common, rollout=sampling, model=FLOAT64)) as one:
        old_1, metrics_1, weights_1 = _train(one, batch, tmp_path / "one")
    two_ranks = {**common, "world_size": 2, "max_tokens_per_micro_batch": 40}
    with Served("actor", make_config(tiny_model, n=2, actor=two_ranks, rollout=sampling, model=FLOAT64)) as two:
        status = two.run(two.client.get_status())
        old_2, metrics_2, weights_2 = _train(two, batch, tmp_path / "two")
        # A checkpoint gathers the shards and RNG states of both ranks, and loads back into both.
        two.run(two.client.save_checkpoint(tmp_path / "ckpt"))
        assert two.run(two.client.load_checkpoint(tmp_path / "ckpt")) == 4
        trained_2 = two.run(two.client.compute_log_probs(batch))["log_probs"]
        # A dead rank is reported, not waited for.
        rank_1 = two.service.engine.group.processes[0]
        rank_1.kill()
        rank_1.wait()
        with pytest.raises(FailedPrecondition, match="died; restart the service"):
            two.run(two.client.compute_log_probs(batch))
    # Full state dicts do not depend on the world size: one rank resumes what two ranks saved.
    with Served("actor", make_config(tiny_model, n=2, actor=common, model=FLOAT64)) as resumed:
        assert resumed.run(resumed.client.load_checkpoint(tmp_path / "ckpt")) == 4
        assert_same_float32(resumed.run(resumed.client.compute_log_probs(batch))["log_probs"], trained_2)
    assert status.world_size == 2
    assert_same_float32(old_2, old_1)
    for m1, m2 in zip(metrics_1, metrics_2, strict=True):
        for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
            assert_same_metric(m2[name], m1[name], name)
    assert metrics_1[1]["actor/ppo_kl"] != 0  # the second update is off-policy: the test compares real work
    assert set(weights_1) <= set(weights_2)
    for name, value in weights_1.items():  # 2 updates x 2 mini-batches
        assert_same_update(weights_2[name], value, lr=common["lr"], steps=4, name=name)


def test_one_process_per_rank_as_a_statefulset_runs_it(tiny_model, tmp_path):
    """What the chart's multi-rank StatefulSet runs: `rlfabric serve actor` in every pod, with RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Rank 0 serves the role; rank 1 runs its command loop and
    answers only health on its port (the pod's probes), readiness once it joined the group."""
    import os
    import socket
    import subprocess
    import sys

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rlfabric.actor.client import ActorClient
    from rlfabric.core.config import dump_config

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    config = tmp_path / "config.yaml"
    dump_config(make_config(tiny_model, n=2, actor={"world_size": 2}, model=FLOAT64), config)
    master, ports = free_port(), [free_port(), free_port()]
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "serve", "actor", "--config", str(config), "--port", str(ports[rank]),
         "--metrics-port", "0"],
        env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(master)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for rank in (0, 1)]
    try:
        for port in ports:  # both pods become ready, as their readiness probes see it
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=120, wait_for_ready=True)
                while reply.status != health_pb2.HealthCheckResponse.SERVING:
                    assert all(r.poll() is None for r in ranks), "a rank exited"
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
        batch = make_batch(rows=4, prompt_len=6, response_len=4)

        async def log_probs():
            async with ActorClient(f"127.0.0.1:{ports[0]}") as client:
                return (await client.get_status()).world_size, (await client.compute_log_probs(batch))["log_probs"]

        import asyncio

        world_size, two = asyncio.run(log_probs())
        assert world_size == 2
        with Served("actor", make_config(tiny_model, n=2, model=FLOAT64)) as one:
            single = one.run(one.client.compute_log_probs(batch))["log_probs"]
        assert_same_float32(two, single)
    finally:
        for rank in ranks:
            rank.terminate()
        for rank in ranks:
            rank.wait(60)
