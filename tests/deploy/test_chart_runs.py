"""The chart's acceptance test: what `helm install` with the default values would run, run here.

No Kubernetes runs on this machine, so the test plays the rendered chart:
- it renders the default values (the stage Job writing the tiny model instead of SmolLM2, which needs PyPI)
  or ci/cpu-values.yaml (the tiny model, the built-in task), with the transformers engine, 2 steps, and
  the mount paths (configPath, auth.mountPath, auth.env.mountPath, persistence.mountPath, tls.mountPath)
  pointed into one temp folder, the mount root;
- writes each rendered ConfigMap and Secret into a folder of its own and uses one folder as the PVC; each
  pod runs in a mount namespace of its own with exactly the volumes its spec mounts bind-mounted at their
  mountPaths on a fresh tmpfs over the mount root (tests/deploy/kubelet.py), so a pod that does not mount
  the PVC does not see it;
- plays cert-manager when the chart asks for a Certificate: a test CA issues it for the names it lists
  into the Secret it names;
- turns every StatefulSet/Deployment replica into a pod: its container's command, args and env as the
  kubelet resolves them (downward API: pod name, namespace, IP, pod index; $(VAR) in args), each pod on
  its own loopback address 127.0.1.N, as each pod has its own IP (so `--host 0.0.0.0` binds that address);
- maps every Service's DNS name to its pods' addresses in a hosts file that tests/deploy/kubelet.py
  bind-mounts on /etc/hosts inside `unshare --mount --net` (a mount and network namespace of its own:
  the machine's /etc/hosts and network are untouched);
- probes every pod as the kubelet does (its readinessProbe: grpc.health.v1 Check of that service name)
  and runs the run Job's command to its end.
Pass: the stage Job puts the model and data on the "PVC" while the pods that mount it wait, the Job exits 0
after both steps, a complete checkpoint (actor and coordinator parts) and the final
model are on the "PVC", and every pod drains and exits 0 on SIGTERM. The same for a multi-turn run with the
chart's env role, the actor and rollout in a two-node resource pool, and mutual TLS from cert-manager (one run for
the three); and a mesh whose actor does not mount the shared volume fails its run at the start with a message
naming the storage requirement.
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

from rlfabric.coordinator.checkpoints import latest_checkpoint, read_state
from tests.deploy.test_helm import CHART, NAMESPACE, RELEASE, helm, parse_manifests, render_chart
from tests.pki import TestCA

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="the stand-in kubelet needs root for its mount and network namespace")]
VENV_BIN = Path(sys.executable).parent


def on_this_machine(values: dict, workdir: Path) -> dict:
    """The values' mount paths moved into workdir/mnt, the mount root (the config's files on the volume with them),
    and what a 2-core machine without vLLM runs in seconds: the transformers engine, 2 steps of 8 tokens."""
    config = values["config"]
    config["rollout"]["engine"] = "hf"
    config["data"]["max_response_length"] = 8
    config["trainer"].update(total_steps=2, progress_bar=False)
    mount_root = workdir / "mnt"
    volume = str(mount_root / "data")
    if config["model"].get("path", "").startswith("/data/"):
        config["model"]["path"] = volume + config["model"]["path"].removeprefix("/data")
    for key in ("train_files", "val_files"):
        config["data"][key] = [volume + f.removeprefix("/data") for f in config["data"].get(key, [])]
    values["configPath"] = str(mount_root / "etc" / "config.yaml")
    values["auth"] = {"mountPath": str(mount_root / "auth"), "env": {"mountPath": str(mount_root / "env-auth")}}
    values.setdefault("persistence", {})["mountPath"] = volume
    values["tls"] = {"mountPath": str(mount_root / "tls")}
    return values


def default_values(workdir: Path) -> dict:
    """The chart's defaults (values.yaml): the stage Job writes the model and the data onto the volume, here the
    tiny model (stage.model tiny, read from /data/models/tiny) where the default writes SmolLM2 from PyPI (no
    package index here, and ~10x the time a step)."""
    values = {"config": yaml.safe_load((CHART / "values.yaml").read_text())["config"], "stage": {"model": "tiny"}}
    values["config"]["model"]["path"] = "/data/models/tiny"
    return on_this_machine(values, workdir)


def cpu_values(workdir: Path, model: Path) -> dict:
    """ci/cpu-values.yaml with the session's tiny model and the built-in task instead of staged files."""
    values = yaml.safe_load((CHART / "ci" / "cpu-values.yaml").read_text())
    config = values["config"]
    config["model"] = {"path": str(model)}
    config["data"].update(train_files=[], val_files=[])
    config["trainer"]["save_freq"] = 0
    values["stage"] = {"enabled": False}
    return on_this_machine(values, workdir)


def with_cert_manager_tls(values: dict) -> dict:
    values["tls"].update(enabled=True, mtls=True, certManager={"enabled": True, "issuerRef": {"name": "mesh-ca"}})
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
    program = container["command"][0]  # rlfabric from this venv, sh from the machine
    executable = str(VENV_BIN / program) if (VENV_BIN / program).exists() else shutil.which(program)
    return [executable, *container["command"][1:], *args], env


def write_volume_sources(docs: list[dict], volumes: Path) -> None:
    """ConfigMaps and Secrets (and, playing cert-manager, each Certificate's Secret) as folders of files."""
    ca = TestCA("mesh-ca")
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            files = {key: value.encode() for key, value in doc["data"].items()}
        elif doc["kind"] == "Secret":
            files = {key: base64.b64decode(value) for key, value in doc["data"].items()}
        elif doc["kind"] == "Certificate":
            cert, key = ca.issue(doc["spec"]["dnsNames"], subject=doc["spec"]["commonName"])
            doc = {"kind": "Secret", "metadata": {"name": doc["spec"]["secretName"]}}
            files = {"tls.crt": cert, "tls.key": key, "ca.crt": ca.pem}
        else:
            continue
        folder = volumes / f"{doc['kind'].lower()}-{doc['metadata']['name']}"
        folder.mkdir(parents=True)
        for key, data in files.items():
            (folder / key).write_bytes(data)


def mounts_of(pod_spec: dict, container: dict, pod_name: str, volumes: Path) -> list[dict]:
    """Each volumeMount of the container with the folder that backs it."""
    sources = {}
    for volume in pod_spec["volumes"]:
        if "configMap" in volume:
            sources[volume["name"]] = volumes / f"configmap-{volume['configMap']['name']}"
        elif "secret" in volume:
            sources[volume["name"]] = volumes / f"secret-{volume['secret']['secretName']}"
        elif "persistentVolumeClaim" in volume:
            sources[volume["name"]] = volumes / f"pvc-{volume['persistentVolumeClaim']['claimName']}"
        elif "emptyDir" in volume:
            sources[volume["name"]] = volumes / "emptydir" / pod_name / volume["name"]
    mounts = []
    for mount in container["volumeMounts"]:
        source = sources[mount["name"]]
        source.mkdir(parents=True, exist_ok=True)
        if mount.get("subPath"):
            source = source / mount["subPath"]
        mounts.append({"source": str(source), "target": mount["mountPath"], "file": bool(mount.get("subPath")),
                       "read_only": bool(mount.get("readOnly"))})
    return mounts


def plan_of(docs: list[dict], workdir: Path, scale_to: dict[str, int] | None = None) -> dict:
    """Pods (argv, env, probe, mounts), hosts and the Job of the rendered manifests. `scale_to`: the most pods a
    component's StatefulSet is scaled to mid-run; the pods past its replicas are planned but not started."""
    volumes = workdir / "volumes"
    write_volume_sources(docs, volumes)
    pods, hosts, headless, by_component = [], {}, {}, {}
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        name, spec = doc["metadata"]["name"], doc["spec"]
        component = spec["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for index in range(max(spec["replicas"], (scale_to or {}).get(component, 0))):
            pod = {"name": f"{name}-{index}", "index": index, "ip": f"127.0.1.{len(pods) + 1}",
                   "component": component, "start": index < spec["replicas"]}
            (container,) = spec["template"]["spec"]["containers"]
            pod["argv"], pod["env"] = resolve(container, pod)
            pod["mounts"] = mounts_of(spec["template"]["spec"], container, pod["name"], volumes)
            pod["init"] = [resolve(init, pod)[0] for init in spec["template"]["spec"].get("initContainers", [])]
            probe = container["readinessProbe"]["grpc"]
            pod["probe"] = {"port": probe["port"], "service": probe.get("service", "")}
            pods.append(pod)
            by_component.setdefault(component, []).append(pod)
            if doc["kind"] == "StatefulSet":
                hosts[f"{pod['name']}.{spec['serviceName']}.{NAMESPACE}.svc"] = pod["ip"]
    for doc in docs:
        if doc["kind"] == "Service" and doc["spec"].get("clusterIP") != "None":
            component = doc["spec"]["selector"]["app.kubernetes.io/component"]
            hosts[f"{doc['metadata']['name']}.{NAMESPACE}.svc"] = by_component[component][0]["ip"]
        elif doc["kind"] == "Service" and doc["spec"].get("publishNotReadyAddresses"):  # every pod that runs
            headless[f"{doc['metadata']['name']}.{NAMESPACE}.svc"] = doc["spec"]["selector"]["app.kubernetes.io/component"]
    jobs = {d["metadata"]["name"].rsplit("-", 1)[1]: job_of(d, f"127.0.1.{250 + i}", volumes)
            for i, d in enumerate(d for d in docs if d["kind"] == "Job")}
    mount_root = workdir / "mnt"
    mount_root.mkdir(parents=True, exist_ok=True)
    # the kubelet writes the hosts file: these names, and each headless name with the pods that run
    return {"workdir": str(workdir), "hosts_file": str(workdir / "hosts"), "hosts": hosts, "headless": headless,
            "mount_root": str(mount_root), "pods": pods, "job": jobs["run"], "stage": jobs.get("stage"),
            "ready_timeout_s": 300, "job_timeout_s": 600}


def job_of(job: dict, ip: str, volumes: Path) -> dict:
    """The pod of a Job (the run's or the stage's): name, argv, env and mounts."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    pod = {"name": f"{job['metadata']['name']}-0", "index": 0, "ip": ip}
    argv, env = resolve(container, pod)
    return {**pod, "argv": argv, "env": env, "mounts": mounts_of(job["spec"]["template"]["spec"], container,
                                                                 pod["name"], volumes)}


def play(docs: list[dict], workdir: Path, scale: list[dict] | None = None) -> tuple[dict, str]:
    """Runs the rendered chart under the stand-in kubelet; returns its result and the pods' logs. `scale`: the
    kubelet's scale events (tests/deploy/kubelet.py) while the run Job runs."""
    scale_to = {}
    for event in scale or []:
        scale_to[event["component"]] = max(scale_to.get(event["component"], 0), event["replicas"])
    plan = plan_of(docs, workdir, scale_to)
    if scale:
        plan.update(scale=scale, metrics_file=str(workdir / "volumes" / f"pvc-{RELEASE}-rlfabric-data" / "runs" /
                                                 RELEASE / "metrics.jsonl"))
    plan_file, result_file = workdir / "plan.json", workdir / "result.json"
    plan_file.write_text(json.dumps(plan))
    repo = CHART.parents[1]
    python_path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(repo)]))
    subprocess.run(["unshare", "--mount", "--net", sys.executable, "-m", "tests.deploy.kubelet", str(plan_file),
                    str(result_file)], cwd=repo, check=True, timeout=1200, env={**os.environ, "PYTHONPATH": python_path})
    result = json.loads(result_file.read_text())
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((workdir / "logs").glob("*.log")))
    assert "error" not in result, f"{result['error']}\n{logs}"
    return result, logs


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        return parse_manifests(render_chart(chart, values))


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model  # the session's: the pods only read it


def check_run_completed(result: dict, logs: str, workdir: Path) -> None:
    job = result["job"]
    assert job["returncode"] == 0, f"{job['stdout']}\n{job['stderr']}\n{logs}"
    lines = job["stdout"].splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/2", "2/2"], lines
    assert lines[-1].endswith("RUN_STATE_COMPLETED at step 2")
    run_dir = workdir / "volumes" / f"pvc-{RELEASE}-rlfabric-data" / "runs" / RELEASE  # trainer.run_dir on the "PVC"
    checkpoint = run_dir / "checkpoints" / "global_step_2"
    assert latest_checkpoint(run_dir) == checkpoint  # complete: coordinator state and the actor's part
    assert read_state(checkpoint).parts == ["actor"] and (checkpoint / "actor" / "model.safetensors").exists()
    assert (run_dir / "final_model" / "model.safetensors").exists()
    assert set(result["exit_codes"].values()) == {0}, result["exit_codes"]  # every pod drained on SIGTERM


def pod_names(docs: list[dict]) -> set[str]:
    return {f"{d['metadata']['name'].removeprefix(f'{RELEASE}-rlfabric-')}-{i}"
            for d in docs if d["kind"] in ("StatefulSet", "Deployment") for i in range(d["spec"]["replicas"])}


def test_helm_install_of_the_default_values_stages_the_model_and_data_and_runs_to_the_end(tmp_path):
    """docs/kubernetes.md's install: the stage Job writes the model and the data where the default config reads
    them, the pods that mount the volume wait for it (their init container), and the run Job completes."""
    workdir = tmp_path / "cluster"
    docs = render(default_values(workdir))
    assert pod_names(docs) == {"actor-0", "rollout-0", "reward-0", "coordinator-0"}  # GRPO: no critic, no reference
    waiting = {d["metadata"]["name"].removeprefix(f"{RELEASE}-rlfabric-") for d in docs
               if d["kind"] in ("StatefulSet", "Deployment") and d["spec"]["template"]["spec"].get("initContainers")}
    assert waiting == {"actor", "rollout", "coordinator"}  # every pod that mounts the volume; not the reward
    result, logs = play(docs, workdir)
    assert result["stage"]["returncode"] == 0, result["stage"]
    check_run_completed(result, logs, workdir)
    volume = workdir / "volumes" / f"pvc-{RELEASE}-rlfabric-data"
    assert (volume / "models" / "tiny" / "config.json").exists()
    assert {p.name for p in (volume / "datasets" / "arithmetic").iterdir()} == {"train.parquet", "val.parquet"}
    (marker,) = (volume / ".rlfabric-staged").iterdir()
    assert marker.is_file()


def log_events(workdir: Path, pod: str) -> list[dict]:
    """The JSON log lines of a pod."""
    lines = (workdir / "logs" / f"{RELEASE}-rlfabric-{pod}.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_an_actor_without_the_shared_volume_fails_the_run_at_its_start(tmp_path, model):
    """A chart edited (or a volume misconfigured) so the actor writes checkpoints to a disk of its own:
    the run fails before its first step, naming the storage the actor and coordinator must share."""
    workdir = tmp_path / "cluster"
    docs = render(cpu_values(workdir, model))
    (actor,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-actor")]
    (container,) = actor["spec"]["template"]["spec"]["containers"]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "data"]
    result, logs = play(docs, workdir)
    job = result["job"]
    assert job["returncode"] != 0, job["stdout"]
    output = job["stdout"] + job["stderr"]
    # The initial save runs beside the first step's generation: the run fails there, before any update.
    assert "RUN_STATE_FAILED at step 0" in output and "must share the run directory" in output, output
    assert "ReadWriteMany" in output, output
    assert not [line for line in job["stdout"].splitlines() if line.startswith("step ")], job["stdout"]


@pytest.fixture(scope="module")
def run_on_a_two_node_pool(tmp_path_factory, model):
    """One chart run (a chart run is most of this module's time) for the three tests below: mutual TLS from
    cert-manager, config.env.enable with a multi-turn run, and config.resource_pools.spread.nodes 2 holding the
    actor and the rollout. The env role joins no pool and no weight-sync group, and TLS changes no message, so no
    test's subject changes another's; TLS covers the env role's connections too.
    Returns (docs, result, logs, workdir)."""
    workdir = tmp_path_factory.mktemp("multi-turn-two-nodes") / "cluster"
    values = cpu_values(workdir, model)
    config = values["config"]
    config["data"].update(builtin_task="lookup", max_response_length=24)
    config["rollout"]["multi_turn"] = {"enable": True, "max_turns": 2, "reward": "env"}
    config["env"] = {"enable": True}
    config.update(resource_pools={"spread": {"nodes": 2}})
    for role in ("actor", "rollout"):
        config.setdefault(role, {})["pool"] = "spread"
    docs = render(with_cert_manager_tls(values))
    result, logs = play(docs, workdir)
    return docs, result, logs, workdir


def test_with_tls_from_cert_manager_and_client_certificates(run_on_a_two_node_pool):
    """tls.certManager: the chart's Certificate, issued here by a test CA for exactly the names it lists,
    carries every connection of the run (services, the env role, weight-sync control, the Job) over mutual TLS."""
    docs, result, logs, workdir = run_on_a_two_node_pool
    (certificate,) = [d for d in docs if d["kind"] == "Certificate"]
    assert certificate["spec"]["issuerRef"]["name"] == "mesh-ca"
    check_run_completed(result, logs, workdir)
    for pod in pod_names(docs):
        (serving,) = [event for event in log_events(workdir, pod) if event["event"] == "serving"]
        assert (serving["tls"], serving["client_certs"], serving["auth"]) == (True, True, True), (pod, serving)


def test_a_multi_turn_run_calls_the_charts_environment_service(run_on_a_two_node_pool):
    """config.env.enable deploys the env role: the rollout replica's agent loops reach it through the
    cluster.env address the chart writes (its Service's DNS name), and the run goes to its end."""
    docs, result, logs, workdir = run_on_a_two_node_pool
    assert pod_names(docs) == {"actor-0", "rollout-0", "reward-0", "env-0", "coordinator-0"}
    check_run_completed(result, logs, workdir)
    metrics_file = workdir / "volumes" / f"pvc-{RELEASE}-rlfabric-data" / "runs" / RELEASE / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert len(steps) == 2
    # Every sample opened its session on the environment (a Reset that fails marks it env_failed) and took a
    # turn. Its Step calls follow only turns the model ends by itself, which the random tiny model may not do in
    # 24 tokens on any one step: agent/env_seconds (Step time) can be 0 in a step that reached the environment.
    for step in steps:
        assert step["agent/env_failed/count"] == 0 and step["agent/turns/mean"] >= 1, step


def test_a_two_node_resource_pool_runs_with_its_pods_apart(run_on_a_two_node_pool):
    """config.resource_pools.<pool>.nodes 2 with the actor and the rollout in the pool: the chart spreads their pods
    over distinct nodes (topologySpreadConstraints, checked in test_helm.py). There is no scheduler here, so what
    this run shows is the rest: every service accepts the two-node pool in its config, and the actor and the rollout,
    each on a pod address of its own, build their weight-sync group and sync every step of a run that completes."""
    docs, result, logs, workdir = run_on_a_two_node_pool
    spread = {d["metadata"]["name"].removeprefix(f"{RELEASE}-rlfabric-") for d in docs
              if d["kind"] in ("StatefulSet", "Deployment") and d["spec"]["template"]["spec"].get("topologySpreadConstraints")}
    assert spread == {"actor", "rollout"}
    check_run_completed(result, logs, workdir)
    events = log_events(workdir, "coordinator-0")
    (group,) = [e for e in events if e["event"] == "weight-sync group built"]
    assert (group["transport"], group["failed"]) == ("gloo", {})
    assert [m.split(".")[0] for m in group["members"]] == [f"{RELEASE}-rlfabric-rollout-0"]  # the rollout pod's name
    syncs = [e for e in events if e["event"] == "weights synced"]
    assert len(syncs) >= 2 and all(s["failed"] == {} for s in syncs), syncs


def test_a_judge_pool_from_the_chart_scores_the_run(tmp_path):
    """config.judge.model_path deploys the judge role: its pod runs `rlfabric serve judge` with the config it
    mounts (a rollout service of the judge model: the quickstart's tiny model that writes 1 for a vowel and 0 for a
    consonant, tests/coordinator/test_judge_pool_run.py), the reward pod's config names it through the judge's
    headless Service, every sample of the run is scored by it, and weight syncs reach the rollout pod only."""
    from rlfabric.quickstart.cached import cached_quickstart_model
    from tests.coordinator.test_judge_pool_run import judge_model

    workdir = tmp_path / "cluster"
    values = cpu_values(workdir, cached_quickstart_model())  # the warm-started policy: one letter per answer
    config = values["config"]
    config["judge"] = {"model_path": str(judge_model(tmp_path / "judge"))}
    config["reward"] = {"judge": {"prompt_template": "any letter of: {response}", "regex": "([01])",
                                  "min_score": 0, "max_score": 1, "max_tokens": 2}}
    config["algorithm"]["max_failed_fraction"] = 1.0  # a verdict that does not parse fails its item, not the run
    values["roles"]["judge"] = {"gpus": 0, "pool": "cpu"}
    docs = render(values)
    assert pod_names(docs) == {"actor-0", "rollout-0", "judge-0", "reward-0", "coordinator-0"}
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")]
    judge_service = f"{RELEASE}-rlfabric-judge-0.{RELEASE}-rlfabric-judge-headless.{NAMESPACE}.svc:50051"
    assert yaml.safe_load(configmap["data"]["config.yaml"])["reward"]["judge"]["addresses"] == [judge_service]
    result, logs = play(docs, workdir)
    check_run_completed(result, logs, workdir)
    (serving,) = [event for event in log_events(workdir, "judge-0") if event["event"] == "serving"]
    assert serving["role"] == "judge"
    metrics_file = workdir / "volumes" / f"pvc-{RELEASE}-rlfabric-data" / "runs" / RELEASE / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    items = config["data"]["train_batch_size"] * config["rollout"]["n"]
    for step in steps:  # reward/judge_failures/* exist only for samples the judge scored: here every one
        assert step["reward/judge_failures/count"] < items, step
    events = log_events(workdir, "coordinator-0")
    (group,) = [e for e in events if e["event"] == "weight-sync group built"]
    assert [m.split(".")[0] for m in group["members"]] == [f"{RELEASE}-rlfabric-rollout-0"]  # not the judge
