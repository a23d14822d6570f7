"""Tracing on a live local mesh: every service exports its spans over OTLP/gRPC to a real receiver
(tests.otlp_receiver), and one training step's spans, from the coordinator, the rollout, the reward
and the actor, form one tree under the step's root span, each RPC's server span the child of the
caller's client span, each client span the child of the step phase that made the call (the checks:
tests/coordinator/traces.py). Here the weights go over grpc; the Prometheus module's traced run, over gloo,
gets the same checks (tests/deploy/test_prometheus_scrape.py), so no mesh boots for one transport alone."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core import tracing
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import TracingConfig, load_config
from rlfabric.launch.local import LocalMesh
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, over_grpc
from tests.coordinator.traces import (
    CLIENT,
    SERVER,
    check_a_steps_spans_form_one_tree_under_its_root,
    check_each_step_is_a_trace_of_its_own,
    step_trace,
)
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow


async def run_to_end(mesh: LocalMesh, timeout_s: float = 300) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
    options = dataclasses.replace(ChannelOptions.from_config(mesh.config), timeout_s=timeout_s)
    async with CoordinatorClient(mesh.endpoints["coordinator"][0]["grpc"], options) as client:
        await client.start_run([])
        async with asyncio.timeout(timeout_s):
            async for _ in client.stream_metrics(timeout_s=timeout_s):
                pass
        return await client.run_status()


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory) -> list[ReceivedSpan]:
    """Two GRPO steps of the quickstart on a mesh tracing to a receiver, weights synced over grpc (the actor's
    handler pushes to the rollout); the receiver's spans once the mesh has stopped (each service flushes its
    spans when it stops). The same checks on a run over gloo (the coordinator calls both ends): the
    Prometheus module's run (tests/deploy/test_prometheus_scrape.py), which traces too."""
    with OtlpReceiver() as receiver:
        config = load_config(None, ["trainer.total_steps=2", "trainer.progress_bar=false", "weight_sync.transport=grpc",
                                    f"tracing.endpoint={receiver.endpoint}", "tracing.service_name_prefix=test-"])
        with LocalMesh(config, tmp_path_factory.mktemp("tracing") / "mesh") as mesh:
            status = asyncio.run(run_to_end(mesh))
        assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
        yield receiver.spans()


def test_a_steps_spans_from_every_service_form_one_tree_under_its_root(traced_run):
    check_a_steps_spans_form_one_tree_under_its_root(traced_run, "grpc")


def test_each_step_is_a_trace_of_its_own(traced_run):
    check_each_step_is_a_trace_of_its_own(traced_run)


async def run_over_grpc(config, run_dir) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
    async with over_grpc(config, run_dir) as coordinator:
        await coordinator.start_run()
        async for _ in coordinator.stream_metrics(from_step=1):
            pass
        return await coordinator.run_status()


def test_async_steps_link_to_the_generation_of_the_samples_they_train_on(tiny_model, tmp_path):
    """trainer.mode=async on the gRPC mesh in this process (tests.coordinator.meshes.over_grpc, every service
    tracing as test-mesh): generation for step 2 starts while step 1 waits (max_staleness 1) in a trace of
    its own, whose root span `generate` holds its GenerateStream and Score calls; every step links to the
    span each of its gen batches ran under when that is not in its own trace, so its samples' generation is
    one click away."""
    with OtlpReceiver() as receiver:
        assert tracing.setup(TracingConfig(endpoint=receiver.endpoint, service_name_prefix="test-"), "mesh")
        try:
            config = fast_config(tiny_model, "trainer.mode=async", "trainer.max_staleness=1", "trainer.total_steps=3")
            status = asyncio.run(run_over_grpc(config, tmp_path / "run"))
        finally:
            tracing.shutdown()  # exports the spans
        received = receiver.spans()
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    by_id = {s.span_id: s for s in received}
    generating = ("rlfabric.v1.RolloutService/GenerateStream", "rlfabric.v1.RewardService/Score")

    linked_generate = set()
    for step in (1, 2, 3):
        root, spans = step_trace(received, step)
        in_trace = sum(s.name == generating[0] and s.kind == CLIENT for s in spans)  # gen batches of this trace
        groups = 0
        for link in root.links:
            target = by_id[link.span_id]
            assert link.trace_id == target.trace_id != root.trace_id
            assert target.name in ("generate", "gen") and target.service == "test-mesh"
            groups += link.attributes["rlfabric.groups"]
            if target.name == "generate":
                assert target.parent_span_id == "" and link.attributes["rlfabric.gen_batch"] == \
                    target.attributes["rlfabric.gen_batch"]
                linked_generate.add(target.span_id)
        assert groups <= config.data.train_batch_size, root.links
        assert groups == config.data.train_batch_size or in_trace, root.links  # the rest: from its own trace
    # The generation that ran ahead: its calls, client and server, all under its `generate` root span.
    for generate_id in linked_generate:
        generate = by_id[generate_id]
        trace = {s.span_id: s for s in received if s.trace_id == generate.trace_id}
        calls = Counter((s.name, s.kind) for s in trace.values())
        for method in generating:
            assert calls[(method, CLIENT)] >= 1 and calls[(method, SERVER)] == calls[(method, CLIENT)], calls
        for span in trace.values():
            node = span
            while node.parent_span_id:
                node = trace[node.parent_span_id]
            assert node is generate
    assert {by_id[g].attributes["rlfabric.step"] for g in linked_generate} >= {2, 3}  # drawn ahead, trained on
