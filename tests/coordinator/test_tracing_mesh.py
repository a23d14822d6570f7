"""Tracing on a live local mesh: every service exports its spans over OTLP/gRPC to a real receiver
(tests.otlp_receiver), and one training step's spans, from the coordinator, the rollout, the reward
and the actor, form one tree under the step's root span, each RPC's server span the child of the
caller's client span, each client span the child of the step phase that made the call."""

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
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

SERVER, CLIENT = 2, 3  # OTLP span kinds


async def run_to_end(mesh: LocalMesh, timeout_s: float = 300) -> coordinator_pb2.GetRunStatusResponse:
    options = dataclasses.replace(ChannelOptions.from_config(mesh.config), timeout_s=timeout_s)
    async with CoordinatorClient(mesh.endpoints["coordinator"][0]["grpc"], options) as client:
        await client.start_run([])
        async with asyncio.timeout(timeout_s):
            async for _ in client.stream_metrics(timeout_s=timeout_s):
                pass
        return await client.run_status()


@pytest.fixture(scope="module", params=["gloo", "grpc"])
def traced_run(request, tmp_path_factory):
    """Two GRPO steps of the quickstart on a mesh tracing to a receiver, weights synced over gloo (the
    coordinator calls both ends) or grpc (the actor's handler pushes to the rollout); the receiver's
    spans once the mesh has stopped (each service flushes its spans when it stops)."""
    with OtlpReceiver() as receiver:
        config = load_config(None, ["trainer.total_steps=2", "trainer.progress_bar=false",
                                    f"weight_sync.transport={request.param}",
                                    f"tracing.endpoint={receiver.endpoint}", "tracing.service_name_prefix=test-"])
        with LocalMesh(config, tmp_path_factory.mktemp("tracing") / "mesh") as mesh:
            status = asyncio.run(run_to_end(mesh))
        assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
        yield request.param, receiver.spans()


def step_trace(spans: list[ReceivedSpan], step: int) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    roots = [s for s in spans if s.name == "train_step" and s.attributes.get("rlfabric.step") == step]
    assert len(roots) == 1, [s.attributes for s in spans if s.name == "train_step"]
    root = roots[0]
    return root, [s for s in spans if s.trace_id == root.trace_id]


def test_a_steps_spans_from_every_service_form_one_tree_under_its_root(traced_run):
    transport, received = traced_run
    root, spans = step_trace(received, step=1)
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    assert root.parent_span_id == "" and root.service == "test-coordinator"
    # One tree: every other span's parent is a span of this trace, and following parents reaches the root.
    for span in spans:
        node, hops = span, 0
        while node.parent_span_id:
            assert node.parent_span_id in by_id, f"{span.name} ({span.service}) hangs under a span not in the trace"
            node, hops = by_id[node.parent_span_id], hops + 1
            assert hops < 20
        assert node is root, f"{span.name} ({span.service}) is not under the step's root"
    assert {"test-coordinator", "test-rollout", "test-reward", "test-actor"} <= {s.service for s in spans}

    parent = lambda span: by_id[span.parent_span_id]  # noqa: E731
    phases = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert {"gen", "adv", "update", "update_weights"} <= set(phases)
    assert all(p.attributes["rlfabric.phase"] == p.name and p.service == "test-coordinator" for p in phases.values())

    def served(method: str, service: str) -> list[ReceivedSpan]:
        """The server spans of `method` in `service`, each checked to hang under a coordinator client span."""
        found = [s for s in spans if s.name == method and s.kind == SERVER]
        assert found, f"no server span of {method} in {sorted({(s.service, s.name, s.kind) for s in spans})}"
        for span in found:
            assert span.service == service and span.attributes["rpc.grpc.status_code"] == 0
            caller = parent(span)
            assert (caller.name, caller.kind) == (method, CLIENT), (caller.name, caller.kind)
        return found

    # 1. generation (a server stream) and scoring, under the gen phase
    for method, service in (("rlfabric.v1.RolloutService/GenerateStream", "test-rollout"),
                            ("rlfabric.v1.RewardService/Score", "test-reward")):
        for span in served(method, service):
            assert parent(parent(span)) is phases["gen"] and parent(span).service == "test-coordinator"
    # 4. the policy update
    for span in served("rlfabric.v1.ActorService/UpdatePolicy", "test-actor"):
        assert parent(parent(span)) is phases["update"]
    # 5. weight sync, under the update_weights phase: gloo, the coordinator calls both ends of the
    #    collective; grpc, the actor's BroadcastWeights handler streams PushWeights to the rollout.
    (broadcast,) = served("rlfabric.v1.ActorService/BroadcastWeights", "test-actor")
    assert parent(parent(broadcast)) is phases["update_weights"]
    if transport == "gloo":
        for span in served("rlfabric.v1.RolloutService/ReceiveWeights", "test-rollout"):
            assert parent(parent(span)) is phases["update_weights"]
    else:
        pushes = [s for s in spans if s.name == "rlfabric.v1.RolloutService/PushWeights" and s.kind == SERVER]
        assert pushes and all(p.service == "test-rollout" for p in pushes)
        for push in pushes:  # one span per stream of the push
            caller = parent(push)
            assert (caller.service, caller.kind, parent(caller)) == ("test-actor", CLIENT, broadcast)

    # Attributes: the step, its samples and tokens, the weights it sampled from and the ones it synced.
    config = load_config(None)
    samples = config.data.train_batch_size * config.rollout.n
    assert root.attributes["rlfabric.samples"] == samples
    assert root.attributes["rlfabric.tokens"] > samples
    sync = phases["update_weights"].attributes
    assert sync["rlfabric.weight_version"] == root.attributes["rlfabric.weight_version"] + 1
    assert sync["rlfabric.bytes_synced"] > 0 and len(sync["rlfabric.replicas"]) == 1
    assert all(s.attributes["server.address"] == "127.0.0.1" and s.attributes["server.port"] > 0
               for s in spans if s.kind == CLIENT)


def test_each_step_is_a_trace_of_its_own(traced_run):
    _, received = traced_run
    _, first = step_trace(received, step=1)
    _, second = step_trace(received, step=2)
    assert first[0].trace_id != second[0].trace_id
    # The same phases and calls in both steps, but for the first step's wait for the fresh run's initial save
    # (it runs while the first step generates, and the step's trainers wait for it).
    shape = lambda spans: Counter((s.service, s.name) for s in spans if s.name != "rlfabric.v1.RewardService/Score")  # noqa: E731
    initial_save = ("test-coordinator", "initial_save")
    assert initial_save in shape(first) and initial_save not in shape(second)
    assert shape(first).keys() - {initial_save} == shape(second).keys()


async def run_over_grpc(config, run_dir) -> coordinator_pb2.GetRunStatusResponse:
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
