"""The trained policy is kept: what `rlfabric train` leaves behind with default settings, and what
Ctrl-C leaves. The real CLI in a subprocess, on the quickstart (tiny model, lean mesh)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SHORT = ["trainer.progress_bar=false", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
         "rollout.n=4", "trainer.plot=false"]


class Train:
    """`rlfabric train ...` with its output collected by a thread."""

    def __init__(self, run_dir: Path, *overrides: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlfabric", "train", "--run-dir", str(run_dir), *SHORT, *overrides],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def wait(self, timeout: float = 400) -> int:
        code = self.process.wait(timeout)
        self._reader.join(10)
        return code

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def printed_paths(self, root: Path) -> list[Path]:
        """Every path under root the CLI printed."""
        return [Path(p) for p in re.findall(re.escape(str(root)) + r"[^\s,)\"]*", self.text)]


def steps_in(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def actor_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The actor's weights in a checkpoint, tied aliases (lm_head = embed_tokens) included."""
    from safetensors.torch import load_file

    weights = load_file(checkpoint / "actor" / "model.safetensors")
    aliases = json.loads((checkpoint / "actor" / "meta.json").read_text()).get("aliases", {})
    return {**weights, **{alias: weights[name] for alias, name in aliases.items()}}


def assert_final_model_is_the_checkpoint(run_dir: Path, checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run_dir / "final_model"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template and tokenizer.apply_chat_template(
        [{"role": "user", "content": "find the vowel: K E B"}], add_generation_prompt=True, tokenize=False)
    saved = actor_weights(checkpoint)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_a_default_run_keeps_a_checkpoint_that_resumes_and_a_final_model_that_loads(tmp_path):
    run_dir = tmp_path / "run"
    first = Train(run_dir, "trainer.total_steps=2")
    assert first.wait() == 0, first.text
    checkpoint = run_dir / "checkpoints" / "global_step_2"
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("global_step_*")) == ["global_step_2"]
    assert_final_model_is_the_checkpoint(run_dir, checkpoint)
    printed = first.printed_paths(run_dir)
    assert checkpoint in printed and run_dir / "final_model" in printed
    assert len(printed) >= 4 and [p for p in printed if not p.exists()] == []  # every path it printed exists

    # The same command with more steps continues from the kept checkpoint.
    resumed = Train(run_dir, "trainer.total_steps=3")
    assert resumed.wait() == 0, resumed.text
    assert "started at step 2" in resumed.text
    assert steps_in(run_dir) == [1, 2, 3]
    assert_final_model_is_the_checkpoint(run_dir, run_dir / "checkpoints" / "global_step_3")


def test_ctrl_c_stops_the_run_with_a_checkpoint_and_the_final_model(tmp_path):
    run_dir = tmp_path / "run"
    train = Train(run_dir, "trainer.total_steps=200")
    deadline = time.monotonic() + 300
    while not steps_in(run_dir):  # the first step's metrics line: the run is training
        assert train.process.poll() is None and time.monotonic() < deadline, train.text
        time.sleep(0.2)
    train.process.send_signal(signal.SIGINT)  # what Ctrl-C sends to the launcher
    assert train.wait() == 130, train.text
    assert "stopping after the current step with a checkpoint" in train.text
    steps = steps_in(run_dir)
    assert 1 <= len(steps) < 200
    latest = int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert latest == steps[-1]  # every trained step is kept
    assert_final_model_is_the_checkpoint(run_dir, run_dir / "checkpoints" / f"global_step_{latest}")
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    for entries in endpoints.values():  # the mesh is gone
        for entry in entries:
            assert not Path(f"/proc/{entry['pid']}").exists() or \
                Path(f"/proc/{entry['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
