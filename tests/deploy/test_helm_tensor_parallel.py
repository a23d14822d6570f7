"""The Helm chart gives each rollout pod (one replica) its rollout.tensor_parallel_size GPUs."""

from __future__ import annotations

import pytest

from tests.deploy.test_helm import (
    chart,  # noqa: F401  (the module's rendered-chart fixture)
    parse_manifests,
    render_chart,
)

pytestmark = pytest.mark.slow


def test_a_rollout_pod_holds_its_replicas_tp_gpus(chart):  # noqa: F811
    values = {"config": {"resource_pools": {"infer": {"gpus": 4}},
                         "rollout": {"pool": "infer", "engine": "vllm", "tensor_parallel_size": 2}},
              "pools": {"infer": {}}, "roles": {"rollout": {"pool": "", "replicas": 2}}}
    workloads = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d
                 for d in parse_manifests(render_chart(chart, values)) if d["kind"] in ("StatefulSet", "Deployment")}
    rollout = workloads["rollout"]
    assert rollout["spec"]["replicas"] == 2  # the pool's 4 GPUs in replicas of 2
    assert rollout["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    actor = workloads["actor"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert actor["nvidia.com/gpu"] == 1  # the setting is the rollout's alone
