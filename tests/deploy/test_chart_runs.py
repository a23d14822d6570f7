"""The chart's acceptance test: what `helm install -f ci/cpu-values.yaml` would run, run here.

No Kubernetes runs on this machine, so the test plays the rendered chart:
- it renders ci/cpu-values.yaml with the config pointed at what exists here (the tiny model instead of a
  hub model, the built-in task instead of GSM8K files on a volume, the transformers engine, 2 steps) and
  the mount paths (configPath, auth.mountPath, persistence.mountPath) pointed at a temp folder;
- writes each rendered ConfigMap and Secret where the pods mount them, and uses one folder as the PVC;
- turns every StatefulSet/Deployment replica into a pod: its container's command, args and env as the
  kubelet resolves them (downward API: pod name, namespace, IP, pod index; $(VAR) in args), each pod on
  its own loopback address 127.0.1.N, as each pod has its own IP (so `--host 0.0.0.0` binds that address);
- maps every Service's DNS name to its pods' addresses in a hosts file that tests/deploy/kubelet.py
  bind-mounts on /etc/hosts inside `unshare --mount --net` (a mount and network namespace of its own:
  the machine's /etc/hosts and network are untouched);
- probes every pod as the kubelet does (its readinessProbe: grpc.health.v1 Check of that service name)
  and runs the run Job's command to its end.
Pass: the Job exits 0 after both steps, a complete checkpoint (actor and coordinator parts) and the final
model are on the "PVC", and every pod drains and exits 0 on SIGTERM.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlfabric.actor.tiny_model import make_tiny_model
from tests.deploy.test_helm import CHART, NAMESPACE, RELEASE, helm, parse_manifests, render_chart

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="the stand-in kubelet needs root for its mount and network namespace")
VENV_BIN = Path(sys.executable).parent


def cpu_values(workdir: Path, model: Path) -> dict:
    values = yaml.safe_load((CHART / "ci" / "cpu-values.yaml").read_text())
    config = values["config"]
    config["model"]["path"] = str(model)
    config["data"].update(train_files=[], val_files=[], max_response_length=8)
    config["rollout"]["engine"] = "hf"
    config["trainer"].update(total_steps=2, save_freq=0, progress_bar=False)
    values["configPath"] = str(workdir / "etc" / "config.yaml")
    values["auth"] = {"mountPath": str(workdir / "auth")}
    values["persistence"]["mountPath"] = str(workdir / "data")
    return values


def field(pod: dict, path: str) -> str:
    known = {"metadata.name": pod["name"], "metadata.namespace": NAMESPACE, "status.podIP": pod["ip"],
             "metadata.labels['apps.kubernetes.io/pod-index']": str(pod["index"])}
    return known[path]


def resolve(container: dict, pod: dict) -> tuple[list[str], dict[str, str]]:
    """argv and env of a container as the kubelet starts it."""
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    for var in container.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else field(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container.get("args", [])]
    if "--host" in args:  # its own network namespace in a pod; here its own address
        args[args.index("--host") + 1] = pod["ip"]
    return [str(VENV_BIN / container["command"][0]), *container["command"][1:], *args], env


def plan_of(docs: list[dict], values: dict, workdir: Path) -> dict:
    """Pods, hosts and the Job of the rendered manifests; ConfigMaps and Secrets written where mounted."""
    config_path, auth_dir = Path(values["configPath"]), Path(values["auth"]["mountPath"])
    for doc in docs:
        if doc["kind"] == "ConfigMap" and "config.yaml" in doc["data"]:
            config_path.parent.mkdir(parents=True, exist_ok=True)
            config_path.write_text(doc["data"]["config.yaml"])
        if doc["kind"] == "Secret":
            auth_dir.mkdir(parents=True, exist_ok=True)
            for key, encoded in doc["data"].items():
                (auth_dir / key).write_bytes(base64.b64decode(encoded))
    pods, hosts, by_component = [], {}, {}
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        name, spec = doc["metadata"]["name"], doc["spec"]
        for index in range(spec["replicas"]):
            pod = {"name": f"{name}-{index}", "index": index, "ip": f"127.0.1.{len(pods) + 1}"}
            (container,) = spec["template"]["spec"]["containers"]
            pod["argv"], pod["env"] = resolve(container, pod)
            probe = container["readinessProbe"]["grpc"]
            pod["probe"] = {"port": probe["port"], "service": probe.get("service", "")}
            pods.append(pod)
            component = spec["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            by_component.setdefault(component, []).append(pod)
            if doc["kind"] == "StatefulSet":
                hosts[f"{pod['name']}.{spec['serviceName']}.{NAMESPACE}.svc"] = pod["ip"]
    for doc in docs:
        if doc["kind"] == "Service" and doc["spec"].get("clusterIP") != "None":
            component = doc["spec"]["selector"]["app.kubernetes.io/component"]
            hosts[f"{doc['metadata']['name']}.{NAMESPACE}.svc"] = by_component[component][0]["ip"]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    job_pod = {"name": f"{job['metadata']['name']}-0", "index": 0, "ip": "127.0.1.250"}
    argv, env = resolve(container, job_pod)
    hosts_file = workdir / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in hosts.items()))
    return {"workdir": str(workdir), "hosts_file": str(hosts_file), "pods": pods,
            "job": {"argv": argv, "env": env}, "ready_timeout_s": 300, "job_timeout_s": 600}


def test_helm_install_of_the_cpu_values_runs_a_training_to_the_end(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    workdir = tmp_path / "cluster"
    values = cpu_values(workdir, model)
    with helm.Chart.load(CHART) as chart:
        docs = parse_manifests(render_chart(chart, values))
    plan = plan_of(docs, values, workdir)
    assert {p["name"].removeprefix(f"{RELEASE}-rlfabric-") for p in plan["pods"]} == {
        "actor-0", "rollout-0", "reward-0", "coordinator-0"}  # GRPO: no critic, no reference
    plan_file, result_file = tmp_path / "plan.json", tmp_path / "result.json"
    plan_file.write_text(json.dumps(plan))
    repo = CHART.parents[1]
    python_path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(repo)]))
    subprocess.run(["unshare", "--mount", "--net", sys.executable, "-m", "tests.deploy.kubelet", str(plan_file),
                    str(result_file)], cwd=repo, check=True, timeout=1200, env={**os.environ, "PYTHONPATH": python_path})
    result = json.loads(result_file.read_text())
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((workdir / "logs").glob("*.log")))
    assert "error" not in result, f"{result['error']}\n{logs}"
    job = result["job"]
    assert job["returncode"] == 0, f"{job['stdout']}\n{job['stderr']}\n{logs}"
    lines = job["stdout"].splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/2", "2/2"], lines
    assert lines[-1].endswith("RUN_STATE_COMPLETED at step 2")
    run_dir = workdir / "data" / "runs" / RELEASE  # the chart's trainer.run_dir on the "PVC"
    checkpoint = run_dir / "checkpoints" / "global_step_2"
    assert (checkpoint / "actor" / "model.safetensors").exists() and (checkpoint / "coordinator.json").exists()
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (run_dir / "final_model" / "model.safetensors").exists()
    assert set(result["exit_codes"].values()) == {0}, result["exit_codes"]  # every pod drained on SIGTERM
