"""Killing the whole mesh mid-run and re-running the same command resumes from the last checkpoint:
no step is repeated or skipped, and every step trains on the batch an uninterrupted run would draw."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfabric.coordinator.checkpoints import latest_checkpoint
from rlfabric.core.host import load_tokenizer
from rlfabric.data.dataset import RLHFDataset

pytestmark = pytest.mark.slow

STEPS, BATCH, SEED = 6, 8, 5


def train_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "rlfabric", "train", "--run-dir", str(run_dir), f"trainer.total_steps={STEPS}",
            "trainer.save_freq=1", f"data.train_batch_size={BATCH}", f"data.seed={SEED}", "rollout.n=2",
            "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", "trainer.progress_bar=false",
            "trainer.plot=false"]


def checkpoint_step(run_dir: Path) -> int:
    """The step of the latest complete checkpoint, 0 if none."""
    latest = latest_checkpoint(run_dir)
    return 0 if latest is None else int(latest.name.removeprefix("global_step_"))


def expected_uids(run_dir: Path) -> dict[int, list[str]]:
    """The prompts of each step in an uninterrupted run: the dataset's seeded order, batch by batch."""
    data = RLHFDataset([run_dir / "data" / "find_vowel" / "train.parquet"], load_tokenizer(str(run_dir / "model")),
                       max_prompt_length=64)
    order = data.epoch_order(0, SEED)
    return {step: [data.rows[i].uid for i in order[(step - 1) * BATCH : step * BATCH]] for step in range(1, STEPS + 1)}


def test_kill_the_mesh_mid_run_and_rerun_the_same_command(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(train_command(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        # Steps take ~1 s: wait for any checkpoint of step 2 or later (a poll may miss step 2's).
        while checkpoint_step(run_dir) < 2:
            assert first.poll() is None, f"the first run ended (exit {first.returncode}) before step 2"
            assert time.monotonic() < deadline, "no checkpoint of step 2 within 400 s"
            time.sleep(0.05)
    finally:
        # The launcher and every service (each leads its own session, with its engine's children): the
        # whole mesh dies at once, as in a power loss.
        endpoints = json.loads((run_dir / "endpoints.json").read_text()) if (run_dir / "endpoints.json").exists() else {}
        pids = [e["pid"] for entries in endpoints.values() for e in entries]
        for group in (first.pid, *pids):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        first.wait()
    deadline = time.monotonic() + 30
    while [pid for pid in pids if Path(f"/proc/{pid}").exists()
           and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]:
        assert time.monotonic() < deadline, "services outlived the kill"
        time.sleep(0.1)

    resume_step = checkpoint_step(run_dir)
    assert 2 <= resume_step < STEPS, f"the first run was not killed mid-run (checkpoint of step {resume_step})"
    second = subprocess.run(train_command(run_dir), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"started at step {resume_step}" in second.stdout, second.stdout

    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # resumed steps replaced, none twice, none missing
    expected = expected_uids(run_dir)
    for step in range(1, STEPS + 1):
        rows = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert [r["uid"] for r in rows[::2]] == expected[step], f"step {step} trained on other prompts"
