"""The run's checkpoints: RUN_DIR/checkpoints/global_step_N/ with the coordinator's state next to the
actor's (and critic's) checkpoint directories, VeRL's layout:

    checkpoints/
        latest_checkpointed_iteration.txt   N of the newest complete checkpoint
        global_step_N/
            coordinator.json   step, dataloader position, KL coefficient, weight version, seeds
            actor/             the actor service's checkpoint (model, optimizer, scheduler, RNG)
            critic/            the critic's, when the run has one

A checkpoint is written into a hidden temporary directory and renamed into place, and the
"latest" file is replaced only after that, so a crash or a full disk mid-save leaves the previous
checkpoint complete and still the one a resume picks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "coordinator.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and why."""


@dataclass
class CoordinatorState:
    """Everything besides the models that a resumed run needs to continue exactly."""

    step: int  # steps completed
    data_epoch: int
    data_position: int
    kl_coef: float
    weight_version: int
    run_id: str = ""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"global_step_{step}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or None."""
    root = checkpoint_root(run_dir)
    latest = root / LATEST_FILE
    if latest.exists():
        path = step_dir(run_dir, int(latest.read_text().strip()))
        if (path / STATE_FILE).exists():
            return path
    # The "latest" file is written last; fall back to the highest complete directory.
    complete = [p for p in root.glob("global_step_*") if _STEP_DIR.match(p.name) and (p / STATE_FILE).exists()]
    return max(complete, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)


def read_state(path: str | Path) -> CoordinatorState:
    """The coordinator state of a checkpoint directory."""
    file = Path(path) / STATE_FILE
    try:
        return CoordinatorState(**json.loads(file.read_text()))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {STATE_FILE} is missing") from None
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{file} is unreadable: {error}") from None


class CheckpointWriter:
    """Writes global_step_N atomically: `tmp = writer.begin(step)`, services save into tmp/<role>,
    then `writer.commit(state)`; `abort()` removes a half-written one."""

    def __init__(self, run_dir: str | Path, keep: int = 0):
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.tmp: Path | None = None
        self.step = 0

    def begin(self, step: int) -> Path:
        root = checkpoint_root(self.run_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.tmp = root / f".global_step_{step}.tmp-{uuid.uuid4().hex[:8]}"
            self.tmp.mkdir()
        except OSError as error:
            raise CheckpointError(f"cannot write checkpoints under {root}: {error}") from None
        self.step = step
        return self.tmp

    def commit(self, state: CoordinatorState) -> Path:
        assert self.tmp is not None, "begin() first"
        final = step_dir(self.run_dir, self.step)
        try:
            (self.tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
            if final.exists():  # a resumed run saving a step again: swap, then drop the old one
                old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            self.tmp.rename(final)
            self.tmp = None
            latest_tmp = final.parent / f".{LATEST_FILE}.tmp"
            latest_tmp.write_text(str(self.step))
            os.replace(latest_tmp, final.parent / LATEST_FILE)
        except OSError as error:
            self.abort()
            raise CheckpointError(f"cannot write checkpoint {final}: {error}") from None
        self._prune()
        return final

    def abort(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        root = checkpoint_root(self.run_dir)
        steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
        for _, path in steps[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)
