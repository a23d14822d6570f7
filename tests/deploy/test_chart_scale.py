"""Issue 49's row "run scaled 2 -> 4 -> 1 rollout replicas mid-run" under the stand-in kubelet: the chart installed
with 2 rollout pods (ci/cpu-values.yaml on this machine: tiny model, transformers engine), then, while the run Job
runs, its rollout StatefulSet scaled to 4 and then to 1 as `kubectl scale` would (docs/kubernetes.md).

What is real: every pod runs the command, args, env and config the chart renders for it; the coordinator finds
the rollout pods only through the chart's rollout.discovery, the rollout headless Service's name; a scaled-down
pod gets SIGTERM and drains by itself. What is stood in (tests/deploy/kubelet.py): the StatefulSet controller
(ordinals started and stopped when the run's metrics show the step the test scales at), and the endpoints
controller with the cluster DNS: the headless name resolves, through a hosts file, to the addresses of the pods
that run (the Service publishes not-ready pods).

Pass: the run completes, every step trains on data.train_batch_size x rollout.n samples, none twice, what a
leaver had in flight was generated again, the replicas go 2 -> 4 -> 1, both joiners catch up from a peer pod (delta
sync over grpc), and every pod, the scaled-down ones too, exits 0."""

from __future__ import annotations

import json

from tests.deploy.test_chart_runs import (  # noqa: F401 - model: its fixture; pytestmark: slow, root and unshare
    RELEASE,
    cpu_values,
    model,
    play,
    pod_names,
    pytestmark,
    render,
)

STEPS = 24  # enough for the new pods to start (~30 s on a loaded 2-core machine) and the rest to follow
ROLLOUT = "rollout"


def test_kubectl_scale_of_the_rollout_statefulset_mid_run_from_2_to_4_to_1(tmp_path, model):  # noqa: F811
    workdir = tmp_path / "cluster"
    values = cpu_values(workdir, model)
    config = values["config"]
    config["trainer"].update(total_steps=STEPS, mode="async", max_staleness=1)
    config["data"]["train_batch_size"], config["rollout"]["n"] = 4, 2  # 8 samples a step: short steps
    # delta sync over grpc: a joiner catches up from a rollout pod that holds the weights, not from the actor
    config["weight_sync"] = {"transport": "grpc", "delta": True}
    config["rollout"]["dtype"] = "bfloat16"
    config["rollout"]["discovery_interval_s"] = 0.5  # the chart's discovery, resolved often: a short test
    values["roles"]["rollout"]["replicas"] = 2
    docs = render(values)
    assert {name for name in pod_names(docs) if name.startswith("rollout")} == {"rollout-0", "rollout-1"}
    scale = [  # kubectl scale statefulset ppo-rlfabric-rollout --replicas=4, then =1
        {"component": ROLLOUT, "replicas": 4, "metric": "rollout/replicas", "value": 2, "steps_after": 0},
        # once a sync reached all 4 and they generated a step's samples
        {"component": ROLLOUT, "replicas": 1, "metric": "weight_sync/replicas", "value": 4, "steps_after": 1},
    ]
    result, logs = play(docs, workdir, scale)

    job = result["job"]
    assert job["returncode"] == 0, f"{job['stdout']}\n{job['stderr']}\n{logs}"
    assert job["events_left"] == [], (job["scaled"], job["events_left"])
    metrics_file = workdir / "volumes" / f"pvc-{RELEASE}-rlfabric-data" / "runs" / RELEASE / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    replicas = [step["rollout/replicas"] for step in steps]
    print(f"rollout replicas per step: {replicas}; scaled after steps {[e['after_steps'] for e in job['scaled']]}")
    assert len(steps) == STEPS and replicas[0] == 2 and replicas[-1] == 1, replicas
    assert 4 in [step["weight_sync/replicas"] for step in steps]  # the joiners held the weights and served
    caught_up = [(step["weight_sync/catchup_from_peer"], step["weight_sync/catchup_from_actor"]) for step in steps]
    print(f"catch-ups (from a peer, from the actor) per step: {caught_up}; full syncs where a delta was due: "
          f"{[step['weight_sync/delta_fallback_full'] for step in steps]}")
    assert [sum(column) for column in zip(*caught_up, strict=True)] == [2, 0]  # both joiners from a peer
    assert sum(step["weight_sync/delta_fallback_full"] for step in steps) == 0  # every sync after the first a delta
    assert sum(step["rollout/joined"] for step in steps) == 2 and sum(step["rollout/left"] for step in steps) == 3
    samples = config["data"]["train_batch_size"] * config["rollout"]["n"]
    for step in steps:
        assert step["rollout/samples"] == samples, step
        assert step["rollout/staleness/max"] <= 1, step
        assert step["rollout/router/duplicate_samples"] == 0, step
        assert step["rollout/router/rework_samples"] == step["rollout/router/failed_inflight_samples"], step
    assert set(result["exit_codes"].values()) == {0}, result["exit_codes"]  # the scaled-down pods drained too
    assert {f"{RELEASE}-rlfabric-rollout-{i}" for i in range(4)} <= result["exit_codes"].keys()
