"""Peak memory of one policy update: rlfabric's UpdatePolicy against TRL GRPOTrainer's training step, on the
same model and micro-batch, each in its own process. Writes bench/results/update_memory.json.

    python -m bench.update_memory_bench [--model DIR] [--rows 8] [--prompt-len 64] [--response-len 128]
                                        [--source OTHER_CHECKOUT/services] [--out PATH]

The batch: `rows` sequences of `prompt-len` prompt tokens and `response-len` response tokens, all real (as
when random weights never stop early); advantages one per row; one optimizer step (no old log-probs: both
sides use the current policy's, detached). The loss is token-mean PPO clip without KL or entropy bonus on
both sides (TRL's loss_type "dapo"). Settings both sides share: float32 master weights, AdamW, grad clip 1.0,
bf16 autocast on a GPU, and gradient checkpointing, measured once on and once off (TRL's default is on;
rlfabric's `auto` is on for a GPU, off on CPU).

What is compared:
- GPU (torch.cuda.max_memory_allocated): the peak torch allocation during the update, weights included.
- CPU: peak resident memory during the update minus the resident memory just before it (the process's
  VmHWM, reset when the update starts), with every weight read once before (transformers maps the
  safetensors file; its pages become resident only when touched). Both processes run with the same glibc setting
  (MALLOC_MMAP_THRESHOLD_) so that large freed blocks go back to the system and resident memory follows
  what is allocated; the loaded model, the libraries and the interpreter are in the baseline.
rlfabric is `rlfabric serve actor` (a real service process) driven over loopback gRPC; its peak is read
from outside, from /proc/<pid>, around the UpdatePolicy call (so an older checkout, --source, measures the
same way). TRL runs bench/trl_update_step.py in its own venv (bench/.venv-trl, as bench.peer_trl_bench).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from bench.peer_trl_bench import trl_python
from rlfabric.actor.client import ActorClient
from rlfabric.core.client import ChannelOptions, wait_until_serving

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "update_memory.json"
TARGET_RATIO = 1.2
MB = 1 << 20
# Same allocator behaviour in both processes: freed blocks over 128 KiB are unmapped at once.
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "TOKENIZERS_PARALLELISM": "false"}


def log(message: str) -> None:
    print(f"[update_memory_bench] {message}", flush=True)


def make_batch(rows: int, prompt_len: int, response_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every token real; token ids in the common range of any tokenizer."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 10_000, (rows, prompt_len + response_len), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, prompt_len:].clone(),
            "response_mask": torch.ones(rows, response_len, dtype=torch.int64),
            "advantages": torch.randn(rows, 1, generator=g).expand(rows, response_len).contiguous()}


# -- /proc of another process (the service) ------------------------------------------------------------------

def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))


# -- rlfabric ------------------------------------------------------------------------------------------------

def start_actor(model: Path, rows: int, checkpointing: bool, work: Path, source: Path | None):
    config = {"model": {"path": str(model), "gradient_checkpointing": checkpointing},
              "rollout": {"n": rows, "temperature": 1.0},
              "actor": {"lr": 1e-6, "ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": rows,
                        "loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "use_kl_loss": False,
                        "weight_decay": 0.0, "grad_clip": 1.0}}
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    env = dict(ENV)
    if source is not None:  # another checkout's services/ as the rlfabric package (before/after figures)
        site = work / "site"
        site.mkdir()
        (site / "rlfabric").symlink_to(source.resolve())
        env["PYTHONPATH"] = str(site)
    port_file = work / "ports.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "serve", "actor", "--config", str(work / "run.yaml"), "--port", "0",
         "--metrics-port", "0", "--port-file", str(port_file)],
        cwd=work, env=env, stdout=open(work / "actor.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"actor did not start: {(work / 'actor.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return process, f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"


async def one_update(address: str, pid: int, batch: dict[str, torch.Tensor]) -> dict:
    await wait_until_serving(address, timeout_s=300)
    async with ActorClient(address, ChannelOptions(timeout_s=1800)) as actor:
        sequences = {name: tensor for name, tensor in batch.items() if name != "advantages"}
        await actor.compute_log_probs(sequences)  # reads every weight: resident before the update, as in a run
        before = rss_mb(pid)
        reset_peak(pid)
        started = time.perf_counter()
        metrics = await actor.update_policy(batch)
        seconds = time.perf_counter() - started
        peak = peak_rss_mb(pid)
    figures = {"rss_before_mb": before, "rss_peak_mb": peak, "update_s": seconds}
    for name in ("device_mb/before_update", "device_mb/peak_update", "device_mb/after_update"):
        if f"memory/actor/{name}" in metrics:
            figures[name.replace("/", "_")] = metrics[f"memory/actor/{name}"]
    return figures


def rlfabric_update(model: Path, batch: dict, checkpointing: bool, root: Path, source: Path | None) -> dict:
    work = Path(tempfile.mkdtemp(dir=root))
    process, address = start_actor(model, batch["input_ids"].shape[0], checkpointing, work, source)
    try:
        return asyncio.run(one_update(address, process.pid, batch))
    finally:
        process.terminate()
        process.wait(60)


# -- TRL -----------------------------------------------------------------------------------------------------

def trl_update(model: Path, batch: dict, checkpointing: bool, root: Path) -> dict:
    prompt_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    spec = {"model": str(model), "prompt_ids": batch["input_ids"][:, :prompt_len].tolist(),
            "completion_ids": batch["responses"].tolist(), "advantages": batch["advantages"][:, 0].tolist(),
            "lr": 1e-6, "gradient_checkpointing": checkpointing, "output_dir": str(root / "trl-out")}
    spec_file, out_file = root / "trl-spec.json", root / "trl-out.json"
    spec_file.write_text(json.dumps(spec))
    subprocess.run([str(trl_python()), str(Path(__file__).parent / "trl_update_step.py"), str(spec_file),
                    str(out_file)], check=True, env=ENV, cwd=root)
    return json.loads(out_file.read_text())


# -- the comparison ------------------------------------------------------------------------------------------

def compare(ours: dict, theirs: dict, cuda: bool) -> dict:
    """The figure each device compares, and rlfabric's over TRL's."""
    if cuda:
        ours_mb, theirs_mb, what = ours["device_mb_peak_update"], theirs["device_peak_mb"], "peak allocated (MiB)"
    else:
        ours_mb = ours["rss_peak_mb"] - ours["rss_before_mb"]
        theirs_mb = theirs["rss_peak_mb"] - theirs["rss_before_mb"]
        what = "peak resident minus resident before the update (MiB)"
    return {"compared": what, "rlfabric_mb": round(ours_mb, 1), "trl_mb": round(theirs_mb, 1),
            "ratio_rlfabric_over_trl": round(ours_mb / theirs_mb, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: SmolLM2-135M)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--source", type=Path, default=None, help="another checkout's services/ for rlfabric")
    parser.add_argument("--checkpointing", choices=("both", "on", "off"), default="both",
                        help="gradient checkpointing on both sides: measured on, off, or both (one pair each)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    if args.model is None:
        from rlfabric.trainer.pretrained import cached_model

        args.model = cached_model("smollm2")
    cuda = torch.cuda.is_available()
    batch = make_batch(args.rows, args.prompt_len, args.response_len)
    trl_python()  # before any measurement: the venv install is slow
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "device": torch.cuda.get_device_name() if cuda else "cpu"},
              "model": args.model.name, "rows": args.rows, "prompt_len": args.prompt_len,
              "response_len": args.response_len, "source": str(args.source or ROOT / "services"),
              "target_ratio": TARGET_RATIO, "settings": {}}
    with tempfile.TemporaryDirectory(prefix="update-memory-bench-") as tmp:
        for checkpointing in {"both": (True, False), "on": (True,), "off": (False,)}[args.checkpointing]:
            name = "gradient_checkpointing" if checkpointing else "no_gradient_checkpointing"
            log(f"{name}: rlfabric UpdatePolicy")
            ours = rlfabric_update(args.model, batch, checkpointing, Path(tmp), args.source)
            log(f"{name}: TRL GRPOTrainer step")
            theirs = trl_update(args.model, batch, checkpointing, Path(tmp))
            result = compare(ours, theirs, cuda)
            report["settings"][name] = {"rlfabric": ours, "trl": theirs, **result}
            log(f"{name}: rlfabric {result['rlfabric_mb']} MiB, TRL {result['trl_mb']} MiB "
                f"({result['ratio_rlfabric_over_trl']}x; {result['compared']})")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")  # after each pair: a slow run keeps what it has
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
