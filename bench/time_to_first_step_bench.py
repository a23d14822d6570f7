"""Time to the first step: `rlfabric train examples/smollm2_arithmetic.yaml` (SmolLM2-135M, vLLM rollout, gloo
weight sync, every role its own process) from the launcher's start to the first step's end, and within it
from StartRun to the first Generate, the figure of issue 31 item 6 (target: at most 5 s plus the weight
transfer). Writes bench/results/time_to_first_step.json.

    python -m bench.time_to_first_step_bench [--repeats 3] [--engine vllm|hf] [--label current] [--append]

Each repeat starts a fresh mesh (a first run saves the initial weights, as `rlfabric train` does) and runs
one step. Measured from outside the coordinator, so the same script times code without the start timings
(run it with PYTHONPATH pointing at an older copy of the package as `rlfabric`, --label hf_before;
before and after were taken in turns with --repeats 1 --append):
- StartRun -> first Generate: the StartRun call's start to the first step's generation start (the step's
  metrics timestamp minus its timing_s/step, which counts from the first generate request);
- weight transfer: the first sync's own time (the run's weight_sync/seconds of step 1 is the second sync,
  so the first one is read from run_start.json when the coordinator writes it, else the step's);
- the coordinator's own per-phase figures (run_start.json) when it writes them.
The figures of a label are kept; other labels' figures in the file stay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "time_to_first_step.json"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_arithmetic.yaml"
OVERRIDES = ["trainer.total_steps=1", "trainer.progress_bar=false", "trainer.plot=false",
             "trainer.export_final=false", "trainer.save_final=false", "rollout.seed=0"]


async def one_run(address: str, options) -> dict:
    """StartRun, then the first step's metrics; the figures of this run (wall times from time.time())."""
    from rlfabric.coordinator.client import CoordinatorClient

    async with CoordinatorClient(address, options) as client:
        asked = time.time()
        started = await client.start_run([])
        answered = time.time()
        async for message in client.stream_metrics(0):
            if message.step >= 1:
                metrics = dict(message.metrics)
                first_generate = message.timestamp - metrics["timing_s/step"]
                break
    return {"run_id": started.run_id, "start_run_rpc_s": answered - asked,
            "start_run_to_first_generate_s": first_generate - asked,
            "first_step_s": metrics["timing_s/step"],
            "step_weight_sync_s": metrics.get("weight_sync/seconds", 0.0),
            "step_weight_sync_gbytes": metrics.get("weight_sync/gbytes", 0.0),
            "start_metrics": {k: v for k, v in metrics.items() if k.startswith("timing_s/start/")},
            "first_step_end_unix": message.timestamp}


def one_repeat(engine: str, workdir: Path) -> dict:
    """A fresh mesh, one run of one step; the launcher's and the run's figures."""
    from rlfabric.core.client import ChannelOptions
    from rlfabric.core.config import load_run_config, run_dir_of
    from rlfabric.launch.local import LocalMesh, log_tail

    launched = time.time()
    config = load_run_config(str(EXAMPLE), [*OVERRIDES, f"rollout.engine={engine}"])
    with LocalMesh(config, workdir / f"run-{time.monotonic_ns()}") as mesh:
        ready = time.time()
        address = mesh.endpoints["coordinator"][0]["grpc"]
        try:
            run = asyncio.run(one_run(address, ChannelOptions.from_config(mesh.config)))
        except Exception:
            for log in sorted((mesh.run_dir / "logs").glob("*.log")):  # the run dir goes with the temp dir
                print(f"== {log.name}\n{log_tail(log, 15)}", flush=True)
            raise
        run_start = run_dir_of(mesh.config) / "run_start.json"
        if run_start.exists():
            run["run_start"] = json.loads(run_start.read_text())
        mesh_start = mesh.run_dir / "mesh_start.json"
        if mesh_start.exists():
            run["mesh_start"] = json.loads(mesh_start.read_text())
    run["mesh_start_s"] = ready - launched
    run["launch_to_first_step_end_s"] = run.pop("first_step_end_unix") - launched
    return run


def summary(repeats: list[dict]) -> dict:
    """Medians over the repeats of every figure, and the target check."""
    def median(key):
        return statistics.median(r[key] for r in repeats)

    out = {key: round(median(key), 3) for key in ("mesh_start_s", "start_run_rpc_s", "start_run_to_first_generate_s",
                                                   "first_step_s", "launch_to_first_step_end_s")}
    with_phases = [r["run_start"] for r in repeats if "run_start" in r]
    if with_phases:
        transfer = statistics.median(p["weight_transfer_s"] for p in with_phases)
        out["first_sync_transfer_s"] = round(transfer, 3)
        out["phases_s"] = {name: round(statistics.median(p["phases_s"][name] for p in with_phases), 3)
                           for name in with_phases[0]["phases_s"]}
        out["target_s"] = round(5.0 + transfer, 3)
        out["meets_target"] = out["start_run_to_first_generate_s"] <= out["target_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--label", default="current",
                        help="the key the figures are kept under (the README quotes hf_before/after, vllm_before/after)")
    parser.add_argument("--append", action="store_true",
                        help="add to the label's repeats (e.g. before and after taken in turns) instead of replacing them")
    args = parser.parse_args(argv)
    import torch

    from rlfabric.trainer.pretrained import cached_model

    cached_model("smollm2")  # converted once per machine, outside the timed part
    repeats = []
    with tempfile.TemporaryDirectory(prefix="ttfs-") as tmp:
        for index in range(args.repeats):
            repeats.append(one_repeat(args.engine, Path(tmp)))
            print(f"repeat {index + 1}: StartRun -> first Generate "
                  f"{repeats[-1]['start_run_to_first_generate_s']:.2f} s", flush=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.append and args.label in results:
        repeats = results[args.label]["repeats"] + repeats
    results[args.label] = {
        "summary": summary(repeats), "repeats": repeats, "engine": args.engine, "example": EXAMPLE.name,
        "overrides": OVERRIDES, "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results[args.label]["summary"], indent=2))


if __name__ == "__main__":
    main()
