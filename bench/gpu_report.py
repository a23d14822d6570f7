"""The GPU check's report (bench.gpu_check): rlfabric against TRL on the same work, and the plot of gpu.png."""

from __future__ import annotations

from pathlib import Path


def pair_summary(phases: dict, workload: dict) -> dict:
    """rlfabric against TRL on the same work: seconds a step (first step apart), its parts, peak memory."""
    def run_of(name):
        return phases.get(name, {}).get("run") or {}

    summary = {"workload": workload}
    for name in ("pair_rlfabric_hf", "pair_rlfabric_vllm"):
        run = run_of(name)
        if run.get("step_s"):
            median = run.get("median", {})
            summary[name] = {"step_s": run["step_s"], "first_step_s": run.get("first_step_s"),
                             "parts_s": {k.removeprefix("timing_s/"): v for k, v in median.items()
                                         if k.startswith("timing_s/") and k != "timing_s/step"},
                             "weight_sync_s": median.get("weight_sync/seconds"),
                             "peak_update_device_mb": median.get("memory/actor/device_mb/peak_update")}
    trl = run_of("pair_trl")
    if trl.get("step_s"):
        summary["pair_trl"] = {"step_s": trl["step_s"], "first_step_s": trl.get("first_step_s"),
                               "peak_device_mb": trl.get("peak_device_mb")}
        for name in ("pair_rlfabric_hf", "pair_rlfabric_vllm"):
            if name in summary:
                summary[f"{name}_over_trl"] = round(summary[name]["step_s"] / trl["step_s"], 3)
    return summary


def plot(results: dict, path: Path) -> str:
    """Seconds a step and peak memory of the pair, and each phase's duration; "" or why there is no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    pair = results.get("pair", {})
    systems = [name for name in ("pair_rlfabric_hf", "pair_rlfabric_vllm", "pair_trl") if name in pair]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [name.removeprefix("pair_").replace("_", " ") for name in systems]
    axes[0].bar(labels, [pair[name]["step_s"] for name in systems], color="tab:blue")
    axes[0].set_ylabel("seconds a step (median after the first)")
    axes[1].bar(labels, [pair[name].get("peak_update_device_mb") or pair[name].get("peak_device_mb") or 0
                         for name in systems], color="tab:orange")
    axes[1].set_ylabel("peak GPU memory of the update (MiB)")
    phases = results.get("phases", {})
    names = list(phases)
    colors = {"ok": "tab:green", "failed": "tab:red", "timeout": "tab:red", "skipped": "tab:gray"}
    axes[2].barh(names, [phases[n].get("seconds", 0) for n in names],
                 color=[colors.get(phases[n].get("status"), "tab:gray") for n in names])
    axes[2].invert_yaxis()
    axes[2].set_xlabel("seconds (green ok, red failed or timed out, gray skipped)")
    for axis in axes:
        axis.grid(alpha=0.3)
    env = phases.get("environment", {})
    fig.suptitle(f"rlfabric GPU check: {env.get('gpu', results.get('device'))}, commit {env.get('commit', '?')}"
                 f"{' (small)' if results.get('small') else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return ""
