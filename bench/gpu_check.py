"""The GPU check (`make gpu-check`): what a person with one GPU runs to see that rlfabric works there and how it
compares with TRL, in at most 8 minutes. Writes bench/results/gpu.json (after every phase, so a check cut
short keeps what it measured), bench/results/gpu.png, and one log per phase in bench/results/gpu-logs/.

    python -m bench.gpu_check                        # one GPU; --budget-s (480) bounds the whole check
    python -m bench.gpu_check --phases quickstart    # some phases only
    python -m bench.gpu_check --device cpu --small   # the plumbing on a CPU in about a minute (a test runs it)

Phases, in this order, each a process of its own with its own time limit and log; one that fails or times
out is recorded and the next one runs; the ones the budget cannot reach any more are recorded as skipped:
    environment           torch, the GPU, which optional packages are here (trl, datasets, vllm, cupy)
    gpu_tests             the gpu-marked tests
    quickstart            `rlfabric train` with the defaults (one GPU, no pools), then trainer.colocated=true
    quickstart_colocated
    pair_model            a SmolLM2-1.7B-shaped Llama with random weights (bench.gpu_model)
    pair_rlfabric_hf      GRPO on it: 16 prompts x 8 samples x 256 tokens, one optimizer step, micro-batch 32,
    pair_trl              bfloat16; rlfabric with the hf engine, then TRL's GRPOTrainer on the same work
    device_tests          the device-dependent test modules (actor, weight sync, hf rollout, the loop)
    pair_rlfabric_vllm    the rlfabric side with rollout.engine vllm, when vLLM is installed

A machine without internet gets what it lacks from a folder of wheels made on one with it (`make gpu-wheels`,
bench.gpu_wheels): before anything else this script installs that folder into a private directory and runs
itself again with it on PYTHONPATH (only the standard library is imported until then).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.gpu_report import pair_summary, plot

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WHEELS = ROOT / "gpu-wheels"  # bench.gpu_wheels writes it; git ignores it
SITE_ENV = "RLFABRIC_GPU_CHECK_SITE"  # set once the wheels are installed: the re-executed check skips setup

GPU_MARKED = ["tests/weight_sync/test_nccl.py", "tests/weight_sync/test_cuda_ipc.py", "tests/trainer/test_offload.py",
              "tests/coordinator/test_colocated_training.py"]
DEVICE_TESTS = ["tests/trainer/test_log_probs.py", "tests/trainer/test_update.py", "tests/trainer/test_offload.py",
                "tests/weight_sync/test_sync_services.py", "tests/weight_sync/test_failures.py",
                "tests/weight_sync/test_reference_sync.py", "tests/weight_sync/test_devices.py",
                "tests/rollout/test_hf_service.py", "tests/rollout/test_actor_agreement.py",
                "tests/coordinator/test_loop.py", "tests/coordinator/test_transport_choice.py"]
# GRPO of the pair, as issue 31 measured it: 16 prompts x 8 samples x 256 tokens, one optimizer step.
# max_prompt_tokens: SmolLM2's chat template adds a default system prompt (~40 tokens); the small mode's
# tokenizer has a token per character.
PAIR = {"prompts": 16, "n": 8, "max_tokens": 256, "micro_batch": 32, "steps": 3, "lr": 1e-6, "max_prompt_tokens": 96}
PAIR_SMALL = {"prompts": 4, "n": 2, "max_tokens": 8, "micro_batch": 4, "steps": 1, "lr": 1e-6,
              "max_prompt_tokens": 320}
QUICK_SMALL = ["--in-process", "trainer.total_steps=1", "data.train_batch_size=4", "rollout.n=2",
               "actor.ppo_mini_batch_size=4", "trainer.export_final=false", "trainer.save_final=false",
               "trainer.plot=false"]
# (phase, time limit in seconds on a GPU) in the order they run.
# gpu_tests: on an H200, 4 xdist workers passed two modules in 60 s and were still in the colocated run.
PHASES = [("environment", 30), ("gpu_tests", 150), ("quickstart", 110), ("quickstart_colocated", 90),
          ("pair_model", 60), ("pair_rlfabric_hf", 200), ("pair_trl", 120), ("device_tests", 150),
          ("pair_rlfabric_vllm", 200)]
MIN_PHASE_S = 20  # a phase that would get less than this of the budget is skipped


def log(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


# -- setup: the wheels of a machine without internet -------------------------------------------------------


def missing_requirements() -> list[str]:
    """rlfabric's requirements this Python lacks (or has too old for the committed stubs)."""
    wanted = {"grpcio": "1.85.1", "grpcio-health-checking": "", "grpcio-status": "", "protobuf": "7.",
              "pydantic": "", "isal": "", "opentelemetry-sdk": "", "opentelemetry-exporter-otlp-proto-grpc": ""}
    missing = []
    for name, prefix in wanted.items():
        try:
            if not importlib.metadata.version(name).startswith(prefix):
                missing.append(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def install_wheels(wheels: Path) -> None:
    """Installs `wheels` into a private folder and runs this check again with it on PYTHONPATH, when rlfabric's
    requirements are missing here and the folder exists; otherwise returns."""
    if os.environ.get(SITE_ENV) or not missing_requirements():
        return
    if not any(wheels.glob("*.whl")):
        sys.exit(f"[gpu_check] this Python lacks {', '.join(missing_requirements())} and {wheels} holds no wheels: "
                 "run `make gpu-wheels` on a machine with internet and copy the folder here (README: GPU check)")
    site = Path(tempfile.gettempdir()) / "rlfabric-gpu-check-site"
    started = time.monotonic()
    log(f"installing {len(list(wheels.glob('*.whl')))} wheels from {wheels} into {site}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                    "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
    link = site / "rlfabric"
    if not link.exists():
        link.symlink_to(ROOT / "services")  # the import package is the services folder (an editable install)
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, SITE_ENV: f"{site}:{time.monotonic() - started:.1f}"}
    os.execve(sys.executable, [sys.executable, "-m", "bench.gpu_check", *sys.argv[1:]], env)


# -- running phases ----------------------------------------------------------------------------------------


@dataclass
class Check:
    device: str
    small: bool
    budget_s: float
    work: Path
    out: Path = RESULTS
    results: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    @property
    def logs(self) -> Path:
        return self.out / "gpu-logs"

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def record(self, phase: str, outcome: dict) -> None:
        self.results.setdefault("phases", {})[phase] = outcome
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=2, default=str) + "\n")

    def command(self, phase: str, argv: list[str], limit_s: float, run_dir: Path | None = None) -> dict:
        """Runs argv (its own session, output to the phase's log) for at most limit_s; a launcher's services
        (recorded in run_dir/ports) are ended by pid if it is cut short."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{phase}.log"
        started = time.monotonic()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        with log_path.open("w") as log_file:
            process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       cwd=ROOT, env=env, start_new_session=True)
            try:
                code = process.wait(timeout=limit_s)
                status = "ok" if code == 0 else "failed"
            except subprocess.TimeoutExpired:
                code, status = None, "timeout"
                end_process_group(process)
        if run_dir is not None:
            end_services(run_dir)
        return {"status": status, "exit_code": code, "seconds": round(time.monotonic() - started, 1),
                "limit_s": round(limit_s, 1), "log": str(log_path.relative_to(ROOT) if log_path.is_relative_to(ROOT)
                                                          else log_path), "command": " ".join(argv[1:])}


def end_process_group(process: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait_s)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def end_services(run_dir: Path) -> None:
    """Kills the services a local launcher started for run_dir (they run in sessions of their own), by the pids
    their port files recorded; nothing when they already exited."""
    for port_file in run_dir.glob("ports/*.json"):
        try:
            os.kill(int(json.loads(port_file.read_text())["pid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            continue


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- what the phases measure -------------------------------------------------------------------------------


def pytest_counts(log_path: Path) -> dict:
    """{"passed": n, "failed": n, ...} from pytest's closing line, and the ids of the failed tests."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", text)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)
    return {"counts": counts, "failed_tests": failed[:50]}


def run_summary(run_dir: Path) -> dict:
    """What a run's metrics.jsonl says: steps, reward first and last, step times (the first step, with its
    warm-up, apart), the phases of a step, weight-sync and memory figures."""
    from rlfabric.coordinator.tracking import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        return {"steps": 0}
    steady = records[1:] or records
    keys = sorted({k for r in records for k in r if k.startswith(("timing_s/", "weight_sync/", "memory/"))})
    summary = {"steps": len(records), "reward_first": records[0].get("critic/score/mean"),
               "reward_last": records[-1].get("critic/score/mean"),
               "first_step_s": records[0].get("timing_s/step"),
               "median": {k: statistics.median(r[k] for r in steady if isinstance(r.get(k), (int, float)))
                          for k in keys if any(isinstance(r.get(k), (int, float)) for r in steady)}}
    summary["step_s"] = summary["median"].get("timing_s/step")
    summary["weight_sync_transport"] = chosen_transport(run_dir)
    return summary


def chosen_transport(run_dir: Path) -> str:
    """The coordinator's "weight-sync transport chosen" line of the run, if it logged one."""
    for path in sorted(run_dir.glob("logs/coordinator*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "weight-sync transport chosen" in line:
                return line.strip()[-300:]
    return ""


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def environment() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": torch.cuda.device_count(), "wheels_site": os.environ.get(SITE_ENV, "").split(":")[0],
            "packages": {name: has(name) for name in ("trl", "datasets", "vllm", "sglang", "cupy", "matplotlib")}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_uuid="GPU-" + str(props.uuid))
    for name in ("transformers", "trl", "vllm", "cupy-cuda12x", "cupy-cuda13x"):
        try:
            info.setdefault("versions", {})[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


# -- the phases --------------------------------------------------------------------------------------------


def rlfabric_train(check: Check, phase: str, limit_s: float, overrides: list[str]) -> dict:
    """`rlfabric train` (in small mode every role in one process) into a run folder of its own."""
    run_dir = check.work / phase
    argv = [sys.executable, "-m", "rlfabric", "train", "--run-dir", str(run_dir), *overrides]
    if check.small:
        argv += QUICK_SMALL
    outcome = check.command(phase, argv, limit_s, run_dir)
    outcome["run"] = run_summary(run_dir)
    return outcome


def phase_environment(check: Check, limit_s: float) -> dict:
    import torch

    info = environment()
    if check.device == "cuda" and not torch.cuda.is_available():
        info["status"] = "failed"
        info["error"] = "--device cuda, but torch sees no GPU: is this the CUDA build of torch?"
    return {"status": "ok", **info}


def phase_pytest(check: Check, phase: str, limit_s: float, modules: list[str], marker: str = "") -> dict:
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *(["-m", marker] if marker else [])]
    if has("xdist") and not check.small:
        argv += ["-n", "4"]  # one GPU holds several tiny models at once
    outcome = check.command(phase, [*argv, *modules], limit_s)
    outcome.update(pytest_counts(ROOT / outcome["log"]))
    return outcome


def phase_gpu_tests(check: Check, limit_s: float) -> dict:
    return phase_pytest(check, "gpu_tests", limit_s, GPU_MARKED[:1] if check.small else GPU_MARKED, marker="gpu")


def phase_device_tests(check: Check, limit_s: float) -> dict:
    return phase_pytest(check, "device_tests", limit_s, ["tests/weight_sync/test_devices.py"] if check.small
                        else DEVICE_TESTS)


def phase_quickstart(check: Check, limit_s: float) -> dict:
    return rlfabric_train(check, "quickstart", limit_s, [])  # the README's quickstart: every default


def phase_quickstart_colocated(check: Check, limit_s: float) -> dict:
    return rlfabric_train(check, "quickstart_colocated", limit_s, ["trainer.colocated=true"])


def tokenizer_dir() -> Path | None:
    """SmolLM2's tokenizer: carried in the wheels folder, or the converted registry model on this machine."""
    for candidate in (WHEELS / "smollm2-tokenizer",
                      Path(os.environ.get("RLFABRIC_CACHE", Path.home() / ".cache" / "rlfabric")) / "models" / "smollm2"):
        if (candidate / "tokenizer.json").exists():
            return candidate
    return None


def phase_pair_model(check: Check, limit_s: float) -> dict:
    if check.small:  # the quickstart's character-level ChatML tokenizer: no download, a 100-token vocabulary
        from rlfabric.quickstart.tiny_model import build_tokenizer

        tokenizer = check.work / "tiny-tokenizer"
        build_tokenizer().save_pretrained(tokenizer)
    else:
        tokenizer = tokenizer_dir()
    if tokenizer is None:
        return {"status": "failed", "error": "no SmolLM2 tokenizer: run `make gpu-wheels` (it writes "
                                             f"{WHEELS / 'smollm2-tokenizer'}) and copy the folder here"}
    from rlfabric.data.prep import write_arithmetic

    write_arithmetic(check.work / "pair-data", train_size=256, val_size=8)
    shape = "tiny" if check.small else "smollm2-1.7b"
    argv = [sys.executable, "-m", "bench.gpu_model", str(check.work / "pair-model"), "--shape", shape,
            "--tokenizer", str(tokenizer), "--device", check.device]
    outcome = check.command("pair_model", argv, limit_s)
    built = check.work / "pair-model" / "gpu_check_model.json"
    if built.exists():
        outcome["model"] = json.loads(built.read_text())
    return outcome


def pair_workload(check: Check) -> dict:
    return PAIR_SMALL if check.small else PAIR


def pair_overrides(check: Check) -> list[str]:
    w = pair_workload(check)
    return [f"model.path={check.work / 'pair-model'}", f"data.train_files=[{check.work / 'pair-data' / 'train.parquet'}]",
            f"data.train_batch_size={w['prompts']}", f"rollout.n={w['n']}", f"data.max_response_length={w['max_tokens']}",
            f"data.max_prompt_length={w['max_prompt_tokens']}", f"actor.ppo_mini_batch_size={w['prompts']}",
            f"actor.ppo_micro_batch_size_per_gpu={w['micro_batch']}",
            f"actor.log_prob_micro_batch_size_per_gpu={w['micro_batch']}", f"actor.lr={w['lr']}",
            "actor.entropy_coeff=0", "model.dtype=bfloat16", f"trainer.total_steps={w['steps']}",
            "trainer.export_final=false", "trainer.save_final=false", "trainer.plot=false",
            "trainer.progress_bar=false"]


def phase_pair_rlfabric_hf(check: Check, limit_s: float) -> dict:
    if not (check.work / "pair-model" / "config.json").exists():
        return {"status": "skipped", "reason": "pair_model did not build the model"}
    return rlfabric_train(check, "pair_rlfabric_hf", limit_s, pair_overrides(check))


def phase_pair_rlfabric_vllm(check: Check, limit_s: float) -> dict:
    if check.small or not has("vllm"):
        return {"status": "skipped", "reason": "vLLM is not installed" if not has("vllm") else "small mode"}
    if not (check.work / "pair-model" / "config.json").exists():
        return {"status": "skipped", "reason": "pair_model did not build the model"}
    return rlfabric_train(check, "pair_rlfabric_vllm", limit_s, [*pair_overrides(check), "rollout.engine=vllm"])


def phase_pair_trl(check: Check, limit_s: float) -> dict:
    if not (has("trl") and has("datasets")):
        return {"status": "skipped", "reason": "trl and datasets are not installed (make gpu-wheels brings them)"}
    if not (check.work / "pair-model" / "config.json").exists():
        return {"status": "skipped", "reason": "pair_model did not build the model"}
    w = pair_workload(check)
    spec = {"model": str(check.work / "pair-model"), "train_parquet": str(check.work / "pair-data" / "train.parquet"),
            "reward_file": str(ROOT / "services" / "reward" / "arithmetic.py"), "prompts_per_step": w["prompts"],
            "n": w["n"], "max_tokens": w["max_tokens"], "lr": w["lr"], "steps": w["steps"], "temperature": 1.0,
            "seed": 0, "output_dir": str(check.work / "pair-trl"), "device": check.device,
            "bf16": check.device == "cuda", "micro_batch": w["micro_batch"],
            "gradient_checkpointing": check.device == "cuda"}  # as rlfabric's actor on a GPU (model.gradient_checkpointing auto)
    spec_path, out_path = check.work / "pair-trl-spec.json", check.work / "pair-trl-out.json"
    spec_path.write_text(json.dumps(spec))
    argv = [sys.executable, str(ROOT / "bench" / "trl_grpo.py"), str(spec_path), str(out_path)]
    outcome = check.command("pair_trl", argv, limit_s)
    if out_path.exists():
        theirs = json.loads(out_path.read_text())
        seconds = [s["seconds"] for s in theirs["steps"]]
        outcome["run"] = {"steps": len(seconds), "first_step_s": seconds[0] if seconds else None,
                          "step_s": statistics.median(seconds[1:] or seconds) if seconds else None,
                          "peak_device_mb": theirs.get("peak_device_mb"), "versions": {
                              k: theirs.get(k) for k in ("trl", "transformers", "torch")}}
    return outcome


PHASE_FUNCTIONS = {"environment": phase_environment, "gpu_tests": phase_gpu_tests, "quickstart": phase_quickstart,
                   "quickstart_colocated": phase_quickstart_colocated, "pair_model": phase_pair_model,
                   "pair_rlfabric_hf": phase_pair_rlfabric_hf, "pair_trl": phase_pair_trl,
                   "device_tests": phase_device_tests, "pair_rlfabric_vllm": phase_pair_rlfabric_vllm}


# -- main --------------------------------------------------------------------------------------------------


def run_check(check: Check, phases: list[str]) -> dict:
    site = os.environ.get(SITE_ENV, "")
    check.results.update(device=check.device, small=check.small, budget_s=check.budget_s,
                         started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if site:
        check.record("setup", {"status": "ok", "seconds": float(site.rpartition(":")[2]), "site": site.partition(":")[0]})
    for name, limit_s in PHASES:
        if name not in phases:
            continue
        left = check.left_s()
        if left < MIN_PHASE_S:
            check.record(name, {"status": "skipped", "reason": f"the check's budget of {check.budget_s:g} s was spent"})
            continue
        limit = min(limit_s * (3 if check.small else 1), left)  # a CPU is slower, and the budget bounds all
        log(f"{name} (at most {limit:.0f} s)")
        started = time.monotonic()
        try:
            outcome = PHASE_FUNCTIONS[name](check, limit)
        except Exception as error:  # one phase's failure is recorded; the next phase runs
            outcome = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
        outcome.setdefault("seconds", round(time.monotonic() - started, 1))
        check.record(name, outcome)
        log(f"{name}: {outcome['status']} in {outcome['seconds']:.0f} s"
            + (f" ({outcome.get('reason') or outcome.get('error')})" if outcome["status"] != "ok" else ""))
    check.results["pair"] = pair_summary(check.results.get("phases", {}), pair_workload(check))
    check.results["seconds"] = round(time.monotonic() - check.started, 1)
    check.results["plot"] = plot(check.results, check.out / "gpu.png") or str(check.out / "gpu.png")
    check.record("report", {"status": "ok", "seconds": 0.0})
    return check.results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny workloads: the check's plumbing, on any machine")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole check's time limit")
    parser.add_argument("--phases", default=",".join(name for name, _ in PHASES), help="comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where gpu.json, gpu.png and gpu-logs/ go")
    parser.add_argument("--work", type=Path, help="scratch folder (runs, model); default: a new temporary one")
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="wheels to install first where rlfabric's "
                                                                      "requirements are missing")
    args = parser.parse_args(argv)
    install_wheels(args.wheels)
    phases = [name.strip() for name in args.phases.split(",") if name.strip()]
    unknown = sorted(set(phases) - set(PHASE_FUNCTIONS))
    if unknown:
        parser.error(f"unknown phase(s) {unknown}; phases are {[name for name, _ in PHASES]}")
    work = args.work or Path(tempfile.mkdtemp(prefix="rlfabric-gpu-check-"))
    check = Check(args.device, args.small, args.budget_s, work, args.out)
    results = run_check(check, phases)
    statuses = {name: phase.get("status") for name, phase in results["phases"].items()}
    log(f"done in {results['seconds']:.0f} s: {statuses}; wrote {args.out / 'gpu.json'}")
    return 0 if all(status in ("ok", "skipped") for status in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
