"""The chart at 256 GPUs (helm/rlfabric/ci/scale-256-values.yaml): 32 nodes of 8, a node pool per role family.

Rendered by Helm's engine (helm-python-sdk), every object validated against the Kubernetes 1.30 schemas
(kubernetes-validate, strict), and each pool placed where its values say: the pods of each role, their GPU
limits, node selectors, tolerations and spread over the run config's resource-pool nodes, and the GPUs of each
pool adding up to its nodes x GPUs per node. test_helm runs its lint and per-object checks on the same file.
"""

from __future__ import annotations

from collections import Counter

import kubernetes_validate as kv
import pytest
import yaml

from tests.deploy.test_helm import CHART, KUBE_VERSION, chart, parse_manifests, render_chart  # noqa: F401

pytestmark = pytest.mark.slow

VALUES = yaml.safe_load((CHART / "ci" / "scale-256-values.yaml").read_text())
NODES, GPUS_PER_NODE = 32, 8
GPU = "nvidia.com/gpu"


def workloads(chart, values) -> dict[str, dict]:  # noqa: F811
    """component -> its StatefulSet or Deployment, every rendered object validated first."""
    docs = parse_manifests(render_chart(chart, values))
    assert len(docs) > 10
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "Certificate"):
            continue  # CRDs kubernetes-validate has no schema for (test_helm checks them structurally)
        kv.validate({k: v for k, v in doc.items() if k != "_template"}, KUBE_VERSION, strict=True)
    return {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] in ("StatefulSet", "Deployment")
    }


def placement(workload: dict) -> dict:
    """What the scheduler is told about one role's pods."""
    spec = workload["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    spread = spec.get("topologySpreadConstraints", [])
    return {
        "pods": workload["spec"]["replicas"],
        "gpus": container["resources"].get("limits", {}).get(GPU, 0),
        "nodeSelector": spec.get("nodeSelector", {}),
        "tolerated": {t["key"]: t.get("value") for t in spec.get("tolerations", [])},
        "min_nodes": spread[0]["minDomains"] if spread else 1,
        "pool_label": workload["spec"]["template"]["metadata"]["labels"].get("rlfabric.io/resource-pool"),
    }


@pytest.fixture(scope="module")
def placed(chart):  # noqa: F811
    return {role: placement(w) for role, w in workloads(chart, VALUES).items()}


def test_each_pool_is_placed_where_its_values_say(placed):
    config, pools, roles = VALUES["config"], VALUES["pools"], VALUES["roles"]
    assert set(placed) == {"actor", "reference", "rollout", "reward", "coordinator"}
    for role, where in placed.items():
        values = roles[role]
        assert where["pods"] == values["replicas"], role
        assert where["gpus"] == values["gpus"], role
        assert where["nodeSelector"] == pools[values["pool"]]["nodeSelector"], role
        assert where["tolerated"] == {
            t["key"]: t.get("value") for t in pools[values["pool"]]["tolerations"]
        }, role
        run_pool = config.get(role, {}).get("pool", "")
        assert where["pool_label"] == (run_pool or None), role
        if run_pool:
            spec = config["resource_pools"][run_pool]
            # The pool's pods fill its nodes exactly (no GPU of a node left over, none short), spread over at
            # least its nodes: a pod that would exceed a node's 8 GPUs stays Pending instead of sharing one.
            assert where["pods"] * where["gpus"] == spec["gpus"] * spec["nodes"], role
            assert where["min_nodes"] == spec["nodes"], role
    # Each role family on nodes of its own: no two pools select the same nodes.
    selectors = Counter(where["nodeSelector"]["rlfabric.io/pool"] for where in placed.values())
    assert selectors == Counter({"train": 1, "reference": 1, "inference": 1, "cpu": 2})


def test_the_pools_add_up_to_32_nodes_of_8_gpus(placed):
    pools = VALUES["config"]["resource_pools"]
    assert sum(p["nodes"] for p in pools.values()) == NODES
    assert {p["gpus"] for p in pools.values()} == {GPUS_PER_NODE}
    assert sum(w["pods"] * w["gpus"] for w in placed.values()) == NODES * GPUS_PER_NODE
    assert (placed["actor"]["pods"], placed["rollout"]["pods"]) == (
        64,
        184,
    )  # 64 FSDP ranks, 184 TP1 replicas
