"""What one traced training step looks like, checked on the spans a mesh exported (tests.otlp_receiver): the
tracing module's run (weights over grpc) and the Prometheus module's run (over gloo) both check their spans
with these, so that each transport's trace is checked without a mesh booted for it alone."""

from __future__ import annotations

from collections import Counter

from rlfabric.core.config import load_config
from tests.otlp_receiver import ReceivedSpan

SERVER, CLIENT = 2, 3  # OTLP span kinds


def step_trace(spans: list[ReceivedSpan], step: int) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    roots = [s for s in spans if s.name == "train_step" and s.attributes.get("rlfabric.step") == step]
    assert len(roots) == 1, [s.attributes for s in spans if s.name == "train_step"]
    root = roots[0]
    return root, [s for s in spans if s.trace_id == root.trace_id]


def check_a_steps_spans_form_one_tree_under_its_root(received: list[ReceivedSpan], transport: str,
                                                     prefix: str = "test-") -> None:
    """Step 1's spans, from the coordinator, rollout, reward and actor (services named PREFIX + role), form one
    tree under its root span; each RPC's server span is the child of its caller's client span, each client
    span the child of the step phase that made the call; weights synced over `transport` (gloo or grpc)."""
    root, spans = step_trace(received, step=1)
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    assert root.parent_span_id == "" and root.service == f"{prefix}coordinator"
    # One tree: every other span's parent is a span of this trace, and following parents reaches the root.
    for span in spans:
        node, hops = span, 0
        while node.parent_span_id:
            assert node.parent_span_id in by_id, f"{span.name} ({span.service}) hangs under a span not in the trace"
            node, hops = by_id[node.parent_span_id], hops + 1
            assert hops < 20
        assert node is root, f"{span.name} ({span.service}) is not under the step's root"
    assert {f"{prefix}coordinator", f"{prefix}rollout", f"{prefix}reward", f"{prefix}actor"} <= {s.service for s in spans}

    parent = lambda span: by_id[span.parent_span_id]  # noqa: E731
    phases = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert {"gen", "adv", "update", "update_weights"} <= set(phases)
    assert all(p.attributes["rlfabric.phase"] == p.name and p.service == f"{prefix}coordinator" for p in phases.values())

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
    for method, service in (("rlfabric.v1.RolloutService/GenerateStream", f"{prefix}rollout"),
                            ("rlfabric.v1.RewardService/Score", f"{prefix}reward")):
        for span in served(method, service):
            assert parent(parent(span)) is phases["gen"] and parent(span).service == f"{prefix}coordinator"
    # 4. the policy update: a client stream of the batch's rows without their padding, or the whole batch where
    #    it is not in that layout (rlfabric.trainer.ragged), as the PPO run of test_prometheus_scrape's is
    updates = {s.name for s in spans if s.kind == SERVER} & {"rlfabric.v1.ActorService/UpdatePolicyStream",
                                                              "rlfabric.v1.ActorService/UpdatePolicy"}
    assert len(updates) == 1, updates
    for span in served(updates.pop(), f"{prefix}actor"):
        assert parent(parent(span)) is phases["update"]
    # 5. weight sync, under the update_weights phase: gloo, the coordinator calls both ends of the
    #    collective; grpc, the actor's BroadcastWeights handler streams PushWeights to the rollout.
    (broadcast,) = served("rlfabric.v1.ActorService/BroadcastWeights", f"{prefix}actor")
    assert parent(parent(broadcast)) is phases["update_weights"]
    if transport == "gloo":
        for span in served("rlfabric.v1.RolloutService/ReceiveWeights", f"{prefix}rollout"):
            assert parent(parent(span)) is phases["update_weights"]
    else:
        pushes = [s for s in spans if s.name == "rlfabric.v1.RolloutService/PushWeights" and s.kind == SERVER]
        assert pushes and all(p.service == f"{prefix}rollout" for p in pushes)
        for push in pushes:  # one span per stream of the push
            caller = parent(push)
            assert (caller.service, caller.kind, parent(caller)) == (f"{prefix}actor", CLIENT, broadcast)

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


def check_each_step_is_a_trace_of_its_own(received: list[ReceivedSpan], prefix: str = "test-") -> None:
    _, first = step_trace(received, step=1)
    _, second = step_trace(received, step=2)
    assert first[0].trace_id != second[0].trace_id
    # The same phases and calls in both steps, but for the first step's wait for the fresh run's initial save
    # (it runs while the first step generates, and the step's trainers wait for it).
    shape = lambda spans: Counter((s.service, s.name) for s in spans if s.name != "rlfabric.v1.RewardService/Score")  # noqa: E731
    initial_save = (f"{prefix}coordinator", "initial_save")
    assert initial_save in shape(first) and initial_save not in shape(second)
    assert shape(first).keys() - {initial_save} == shape(second).keys()
