"""A stand-in kubelet for the chart's acceptance test: runs a plan of pods and a Job as local processes.

    unshare --mount --net python -m tests.deploy.kubelet PLAN.json RESULT.json

Run in a network and mount namespace of its own, it brings up the loopback interface, bind-mounts the
plan's hosts file on /etc/hosts (so the Services' DNS names resolve to the pods' addresses, each pod its
own 127.0.1.x address, as each pod has its own IP in a cluster), starts every pod's container command in
a mount namespace of the pod's own where its volumes are mounted as the pod spec says (see pod_command),
runs the stage Job (when the plan has one) while the pods' init containers wait for it, probes each pod as
the kubelet does (grpc.health.v1 Check with the probe's service name, on the probe's port) until all are
SERVING, runs the run Job to its end, stops the pods with SIGTERM and writes what
happened to RESULT.json. The plan (argv and env already resolved from the rendered manifests) is made by
tests/deploy/test_chart_runs.py.

Scaling (the plan's "scale", tests/deploy/test_chart_scale.py): while the run Job runs, each event scales a
StatefulSet as `kubectl scale` would once the run's metrics (metrics.jsonl on the "PVC") show a step with the
event's metric at its value and `steps_after` more steps: the StatefulSet controller's part (new ordinals
started, the highest ones sent SIGTERM) and the endpoints controller's and cluster DNS's for the headless
Services, which publish not-ready pods: each headless name resolves to the addresses of the pods that run, in
the hosts file, rewritten in place (the bind mount on /etc/hosts sees it) whenever a pod starts or exits.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def pod_command(pod: dict, mount_root: str) -> list[str]:
    """The pod's argv wrapped so it runs in a mount namespace of its own: a fresh tmpfs on mount_root (the
    folder every mountPath of the test's values lies in) hides whatever other pods mounted there, then
    each of the pod's volumes is bind-mounted at its mountPath (read-only where the spec says). A pod sees
    the shared "PVC" only if its spec mounts it; without it, it writes into its own tmpfs, as a pod writes
    into its container's filesystem. Mounts outside mount_root (/tmp, /dev/shm) are left as they are. The pod's
    init containers (their argv; they mount what the main container mounts) run first, as the kubelet runs them."""
    steps = ["set -e", f"mount -t tmpfs -o mode=0755 pod {shlex.quote(mount_root)}"]
    for mount in pod["mounts"]:
        if not mount["target"].startswith(mount_root + "/"):
            continue  # e.g. /tmp: the test's own files live there
        target, source = shlex.quote(mount["target"]), shlex.quote(mount["source"])
        if mount["file"]:
            steps.append(f"mkdir -p $(dirname {target}) && touch {target}")
        else:
            steps.append(f"mkdir -p {target}")
        steps.append(f"mount --bind {source} {target}")
        if mount["read_only"]:
            steps.append(f"mount -o remount,bind,ro {target}")
    steps += [shlex.join(argv) for argv in pod.get("init", [])]  # its init containers, in order, to their end
    steps.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(steps), pod["name"], *pod["argv"]]


def start_pod(pod: dict, mount_root: str, logs: Path) -> subprocess.Popen:
    log = open(logs / f"{pod['name']}.log", "wb")  # noqa: SIM115 - the pod's lifetime
    return subprocess.Popen(pod_command(pod, mount_root), env=pod["env"], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def serving(address: str, service: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def await_readiness(pods: list[dict], processes: dict[str, subprocess.Popen], timeout_s: float) -> dict:
    """Seconds until each pod's readiness probe answered SERVING; raises if a pod exits or time runs out."""
    started, ready = time.monotonic(), {}
    while len(ready) < len(pods):
        for pod in pods:
            if pod["name"] in ready:
                continue
            if processes[pod["name"]].poll() is not None:
                raise RuntimeError(f"pod {pod['name']} exited with {processes[pod['name']].returncode}")
            probe = pod["probe"]
            if serving(f"{pod['ip']}:{probe['port']}", probe["service"]):
                ready[pod["name"]] = round(time.monotonic() - started, 2)
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"not ready after {timeout_s} s: {sorted({p['name'] for p in pods} - set(ready))}")
        time.sleep(0.2)
    return ready


def write_hosts(plan: dict, running: set[str]) -> None:
    """The hosts file as DNS answers now: the fixed names, and each headless name with the pods that run."""
    lines = ["127.0.0.1 localhost", *(f"{ip} {name}" for name, ip in plan["hosts"].items())]
    for name, component in plan.get("headless", {}).items():
        lines += [f"{pod['ip']} {name}" for pod in plan["pods"] if pod["component"] == component
                  and pod["name"] in running]
    with open(plan["hosts_file"], "r+") as hosts:  # in place: /etc/hosts is a bind mount of this file
        hosts.truncate(0)
        hosts.write("".join(f"{line}\n" for line in lines))


def steps_done(metrics_file: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def due(event: dict, steps: list[dict]) -> bool:
    """A step shows the event's metric at its value, and `steps_after` more steps followed it."""
    hits = [i for i, step in enumerate(steps) if step.get(event["metric"]) == event["value"]]
    return bool(hits) and len(steps) - 1 >= hits[0] + event["steps_after"]


def scale(plan: dict, event: dict, processes: dict[str, subprocess.Popen], logs: Path, steps: int) -> dict:
    """The StatefulSet of event["component"] to event["replicas"] pods: new ordinals started, the highest sent
    SIGTERM (they drain and exit by themselves); the event and the steps done when it fired."""
    pods = [pod for pod in plan["pods"] if pod["component"] == event["component"]]
    for pod in pods[: event["replicas"]]:
        if pod["name"] not in processes:
            processes[pod["name"]] = start_pod(pod, plan["mount_root"], logs)
    for pod in pods[event["replicas"] :]:
        process = processes.get(pod["name"])
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    return {**event, "after_steps": steps}


def run_scaled_job(job: dict, plan: dict, processes: dict[str, subprocess.Popen], logs: Path) -> dict:
    """The run Job to its end while the plan's scale events fire; what run_job reports and the events fired."""
    events, fired, published = list(plan.get("scale", [])), [], None
    done: dict = {}
    runner = threading.Thread(target=lambda: done.update(run_job(job, plan)), daemon=True)
    runner.start()
    while runner.is_alive():
        steps = steps_done(Path(plan["metrics_file"]))
        while events and due(events[0], steps):
            fired.append(scale(plan, events.pop(0), processes, logs, len(steps)))
        running = {name for name, process in processes.items() if process.poll() is None}
        if running != published:
            write_hosts(plan, running)
            published = running
        runner.join(0.2)
    return {**done, "scaled": fired, "events_left": events}


def run_job(job: dict, plan: dict) -> dict:
    """A Job's pod to its end: its exit status, output and seconds."""
    started = time.monotonic()
    done = subprocess.run(pod_command(job, plan["mount_root"]), env=job["env"], capture_output=True, text=True,
                          timeout=plan["job_timeout_s"])
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
            "seconds": round(time.monotonic() - started, 2)}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    result_path = Path(sys.argv[2])
    logs = Path(plan["workdir"]) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    Path(plan["hosts_file"]).touch()
    write_hosts(plan, {pod["name"] for pod in plan["pods"] if pod.get("start", True)})  # as the pods start
    subprocess.run(["mount", "--bind", plan["hosts_file"], "/etc/hosts"], check=True)
    processes: dict[str, subprocess.Popen] = {}
    result: dict = {}
    try:
        for pod in plan["pods"]:
            if pod.get("start", True):
                processes[pod["name"]] = start_pod(pod, plan["mount_root"], logs)
        if plan.get("stage"):  # the stage Job runs beside the pods, which wait for it in their init containers
            result["stage"] = run_job(plan["stage"], plan)
            if result["stage"]["returncode"] != 0:
                raise RuntimeError(f"the stage Job failed: {result['stage']['stderr'][-2000:]}")
        result["ready_s"] = await_readiness([p for p in plan["pods"] if p["name"] in processes], processes,
                                            plan["ready_timeout_s"])
        result["job"] = run_scaled_job(plan["job"], plan, processes, logs) if plan.get("scale") else run_job(
            plan["job"], plan)
    except Exception as error:  # reported to the test, with the pods' logs
        result["error"] = f"{type(error).__name__}: {error}"
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for name, process in processes.items():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            result.setdefault("exit_codes", {})[name] = process.returncode
        result_path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
