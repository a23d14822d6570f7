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


def test_ctrl_c_keeps_a_checkpoint_and_the_same_command_resumes_to_a_final_model_that_loads(tmp_path):
    """One journey (each `rlfabric train` boots a mesh of its own): Ctrl-C stops a run with a checkpoint and the
    final model; the same command with a reachable total_steps resumes from it and ends, with default settings,
    keeping the end's checkpoint and a final model that loads."""
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
    stopped = int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert stopped == steps[-1]  # every trained step is kept
    assert_final_model_is_the_checkpoint(run_dir, run_dir / "checkpoints" / f"global_step_{stopped}")
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    for entries in endpoints.values():  # the mesh is gone
        for entry in entries:
            assert not Path(f"/proc/{entry['pid']}").exists() or \
                Path(f"/proc/{entry['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"

    # The same command with two more steps continues from the kept checkpoint and runs to its end.
    end = stopped + 2
    resumed = Train(run_dir, f"trainer.total_steps={end}")
    assert resumed.wait() == 0, resumed.text
    assert f"started at step {stopped}" in resumed.text
    assert steps_in(run_dir) == list(range(1, end + 1))
    checkpoint = run_dir / "checkpoints" / f"global_step_{end}"
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(end)
    # By default a run saves at its end (and when stopped), not every step: nothing at stopped + 1.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("global_step_*")) == sorted(
        [f"global_step_{stopped}", f"global_step_{end}"])
    assert_final_model_is_the_checkpoint(run_dir, checkpoint)
    printed = resumed.printed_paths(run_dir)
    assert checkpoint in printed and run_dir / "final_model" in printed
    assert len(printed) >= 4 and [p for p in printed if not p.exists()] == []  # every path it printed exists
