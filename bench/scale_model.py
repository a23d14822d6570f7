"""The coordinator's paper model: its measured costs fitted and extrapolated to 1,024 GPUs (docs/scale-model.md).

    python -m bench.scale_model      # bench/results/scale_model.{json,png} from the bench results below

Reads bench/results/scale.json (the coordinator against N sim replicas: CPU, critical path and RSS per step),
coordinator_samples.json (the padded update batch's bytes per sample, and which part of the per-sample work
touches token arrays) and the chart's 256-GPU layout (helm/rlfabric/ci/scale-256-values.yaml: the rollout's share of the
GPUs). Each cost is fitted by least squares as a + b x samples + c x replicas over every measured point, and
evaluated for a cluster of G GPUs with G x (rollout share) TP1 replicas, each generating the issue's target load
(4,096 x 16 samples over 256 replicas) in a 60 s step. Nothing here measures: rerun it after `make bench
BENCH=scale`; `make docs` runs it, then bench.figures, which writes the page's tables.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "scale_model.json"
PLOT = RESULTS / "scale_model.png"
LAYOUT = ROOT / "helm" / "rlfabric" / "ci" / "scale-256-values.yaml"

STEP_S = 60.0  # the simulated generation per step
SAMPLES_PER_REPLICA = 4096 * 16 / 256  # the target batch over its 256 replicas
OVERHEAD_SHARE = 0.05  # target: the work after the last sample, at most 5% of the step
RSS_LIMIT_MB = 4 * 1024  # target: coordinator RSS <= 4 GiB
GPUS = (64, 128, 256, 512, 768, 1024)
# What the model fits: the scale bench's key -> (name, unit of its coefficients).
COSTS = {
    "coordinator_cpu_s_per_step": "cpu_s",
    "after_last_sample_s_median": "after_last_sample_s",
    "coordinator_peak_rss_mb": "rss_mb",
}
# The in-process stages of coordinator_samples.json that read or copy token arrays.
TOKEN_STAGES = ("decode", "batch", "update_request")


def fit(points: list[dict], key: str) -> dict:
    """key ~ a + b x samples + c x replicas by least squares: {a, b, c, max_residual}."""
    x = np.array([[1.0, p["samples"], p["replicas"]] for p in points])
    y = np.array([p[key] for p in points])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    return {
        "a": float(a),
        "b": float(b),
        "c": float(c),
        "max_residual": float(np.abs(y - x @ (a, b, c)).max()),
    }


def rollout_share() -> float:
    """The rollout replicas' share of the GPUs in the chart's 256-GPU layout (one GPU each, TP1)."""
    roles = yaml.safe_load(LAYOUT.read_text())["roles"]
    gpus = {role: r["replicas"] * r["gpus"] for role, r in roles.items() if r.get("enabled") is not False}
    return gpus["rollout"] / sum(gpus.values())


def load(gpus: int, share: float) -> tuple[int, float]:
    """(rollout replicas, samples per step) of a cluster of `gpus` GPUs."""
    replicas = round(gpus * share)
    return replicas, replicas * SAMPLES_PER_REPLICA


def cost(model: dict, replicas: int, samples: float) -> float:
    return model["a"] + model["b"] * samples + model["c"] * replicas


def crossing(model: dict, limit: float, share: float, per_sample_extra: float = 0.0) -> float:
    """The GPUs at which the cost (plus per_sample_extra per sample) reaches `limit`, the load growing with them."""
    per_replica = (model["b"] + per_sample_extra) * SAMPLES_PER_REPLICA + model["c"]
    return (limit - model["a"]) / per_replica / share


def derive(scale: dict, samples_bench: dict, share: float) -> dict:
    points = scale["points"]
    models = {name: fit(points, key) for key, name in COSTS.items()}
    biggest = max(samples_bench["points"], key=lambda p: p["samples"])
    request_mb_per_sample = biggest["update_request_mb"] / biggest["samples"]
    token_share = sum(biggest["cpu_s"][stage] for stage in TOKEN_STAGES) / biggest["cpu_s_total"]
    in_process_s = biggest["cpu_s_total"] / biggest["samples"]  # the work after generation, per sample
    cpu = models["cpu_s"]
    # A data plane beside gRPC: the token arrays never reach the coordinator, which keeps ids, lengths and scores.
    data_plane = {**cpu, "b": cpu["b"] - token_share * in_process_s}
    crossings = {
        "rss_4gib": crossing(models["rss_mb"], RSS_LIMIT_MB, share),
        "after_last_sample_5pct": crossing(models["after_last_sample_s"], OVERHEAD_SHARE * STEP_S, share),
        "cpu_saturated": crossing(cpu, STEP_S, share),
        "cpu_saturated_data_plane": crossing(data_plane, STEP_S, share),
    }
    rows = []
    for gpus in GPUS:
        replicas, samples = load(gpus, share)
        cpu_s = cost(cpu, replicas, samples)
        rows.append(
            {
                "gpus": gpus,
                "replicas": replicas,
                "samples": int(samples),
                "cpu_s": cpu_s,
                "cpu_per_sample_s": cpu["b"] * samples,
                "cpu_per_replica_s": cpu["c"] * replicas,
                "core_share": cpu_s / STEP_S,
                "shards_needed": math.ceil(cpu_s / STEP_S),
                "cpu_s_data_plane": cost(data_plane, replicas, samples),
                "after_last_sample_s": cost(models["after_last_sample_s"], replicas, samples),
                "rss_mb": cost(models["rss_mb"], replicas, samples),
                "metric_series": scale["points"][-1]["series_per_replica"] * replicas,
            }
        )
    return {
        "sources": [
            "bench/results/scale.json",
            "bench/results/coordinator_samples.json",
            "helm/rlfabric/ci/scale-256-values.yaml",
        ],
        "assumptions": {
            "step_s": STEP_S,
            "samples_per_replica": SAMPLES_PER_REPLICA,
            "rollout_share": share,
            "overhead_share": OVERHEAD_SHARE,
            "rss_limit_mb": RSS_LIMIT_MB,
        },
        "fits": models,
        "fitted_points": len(points),
        "update_request_mb_per_sample": request_mb_per_sample,
        "in_process_cpu_s_per_sample": in_process_s,
        "token_share_of_in_process_cpu": token_share,
        "data_plane_cpu_s_per_sample": data_plane["b"],
        "crossings_gpus": crossings,
        "rows": rows,
    }


def plot(model: dict, scale: dict) -> None:
    """Measured against fitted CPU per step, and the extrapolated costs against their limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (measured, cpu, memory) = plt.subplots(1, 3, figsize=(14, 4.2))
    fit_cpu = model["fits"]["cpu_s"]
    for replicas in sorted({p["replicas"] for p in scale["points"]}):
        these = sorted((p for p in scale["points"] if p["replicas"] == replicas), key=lambda p: p["samples"])
        line = measured.plot(
            [p["samples"] for p in these],
            [p["coordinator_cpu_s_per_step"] for p in these],
            "o",
            label=f"{replicas} replicas",
        )[0]
        xs = np.linspace(0, max(p["samples"] for p in scale["points"]) * 1.05, 20)
        measured.plot(
            xs, [cost(fit_cpu, replicas, x) for x in xs], "--", color=line.get_color(), linewidth=0.8
        )
    measured.set(
        xlabel="samples per step", ylabel="coordinator CPU s / step", title="measured (o) and fit (--)"
    )
    measured.legend(fontsize=7)
    rows = model["rows"]
    gpus = [r["gpus"] for r in rows]
    cpu.plot(gpus, [r["cpu_s"] for r in rows], "o-", label="coordinator CPU / step")
    cpu.plot(gpus, [r["cpu_s_data_plane"] for r in rows], "s:", label="same, tokens on a data plane")
    cpu.plot(gpus, [r["after_last_sample_s"] for r in rows], "^-", label="after the last sample")
    cpu.axhline(STEP_S, color="k", linewidth=0.8, label="the 60 s step (one core saturated)")
    cpu.axhline(OVERHEAD_SHARE * STEP_S, color="grey", linestyle="--", linewidth=0.8, label="5% of the step")
    cpu.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="seconds", title="CPU, extrapolated")
    memory.plot(gpus, [r["rss_mb"] / 1024 for r in rows], "o-", label="coordinator peak RSS")
    memory.axhline(RSS_LIMIT_MB / 1024, color="k", linewidth=0.8, label="4 GiB RSS target")
    memory.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="GiB", title="memory, extrapolated")
    for ax in (cpu, memory):
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=90)


def table(model: dict) -> str:
    """docs/generated/scale-model.md: the fitted costs, the extrapolation and where each limit is crossed."""
    fits = model["fits"]
    units = {
        "cpu_s": ("coordinator CPU", 1e3, "ms", 1e6, "µs", 1e3, "ms"),
        "after_last_sample_s": ("after the last sample (wall)", 1e3, "ms", 1e6, "µs", 1e3, "ms"),
        "rss_mb": ("coordinator peak RSS", 1, "MB", 1e3, "KB", 1e3, "KB"),
    }
    lines = [
        "| cost per step | fixed | per sample | per replica | largest residual |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, (what, ka, ua, kb, ub, kc, uc) in units.items():
        f = fits[name]
        lines.append(
            f"| {what} | {f['a'] * ka:.0f} {ua} | {f['b'] * kb:.0f} {ub} | {f['c'] * kc:.{1 if uc == 'ms' else 0}f} {uc} "
            f"| {f['max_residual'] * ka:.0f} {ua} |"
        )
    lines += [
        "",
        f"Fitted by least squares over the {model['fitted_points']} points of `bench/results/scale.json`.",
        "",
        "| cluster | rollout replicas | samples / step | coordinator CPU / step (per sample + per replica) "
        "| share of one core | tokens on a data plane | after the last sample | peak RSS | metric series |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in model["rows"]:
        lines.append(
            f"| {r['gpus']:,} GPUs | {r['replicas']} | {r['samples']:,} | {r['cpu_s']:.1f} s "
            f"({r['cpu_per_sample_s']:.1f} + {r['cpu_per_replica_s']:.1f}) | {r['core_share']:.0%} "
            f"| {r['cpu_s_data_plane']:.1f} s | {r['after_last_sample_s']:.1f} s "
            f"({r['after_last_sample_s'] / model['assumptions']['step_s']:.0%}) | {r['rss_mb'] / 1024:.1f} GiB "
            f"| {r['metric_series']:,} |"
        )
    names = {
        "rss_4gib": "coordinator RSS reaches 4 GiB",
        "after_last_sample_5pct": "the work after the last sample reaches 5% of the step",
        "cpu_saturated": "the coordinator's CPU per step reaches the step (one core saturated)",
        "cpu_saturated_data_plane": "the same with the token arrays on a data plane",
    }
    lines += ["", "| limit | crossed at |", "| --- | --- |"]
    for key, gpus in sorted(model["crossings_gpus"].items(), key=lambda item: item[1]):
        lines.append(f"| {names[key]} | {gpus:,.0f} GPUs |")
    return "\n".join(lines) + "\n"


def current() -> dict:
    """The model as the results and the layout now give it (bench/results/scale_model.json must equal it)."""
    return derive(
        json.loads((RESULTS / "scale.json").read_text()),
        json.loads((RESULTS / "coordinator_samples.json").read_text()),
        rollout_share(),
    )


def main() -> None:
    model = current()
    OUT.write_text(json.dumps(model, indent=1) + "\n")
    plot(model, json.loads((RESULTS / "scale.json").read_text()))
    print(f"wrote {OUT.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
