"""The run's checkpoints: RUN_DIR/checkpoints/global_step_N/ with the coordinator's state next to the
actor's (and critic's) checkpoint directories, VeRL's layout:

    checkpoints/
        latest_checkpointed_iteration.txt   N of the newest complete checkpoint
        global_step_N/
            coordinator.json   step, dataloader position, KL coefficient, weight version, seeds
            actor/             the actor service's checkpoint (model, optimizer, scheduler, RNG)
            critic/            the critic's, when the run has one

A checkpoint is written into a hidden temporary directory, fsynced and renamed into place, and the
"latest" file is replaced (temp file, fsync, rename) only after that, so a crash, a power loss or a
full disk mid-save leaves the previous checkpoint complete and still the one a resume picks.

The actor and critic write their parts from their own machines (pods), so the run directory must be
storage they all share (a ReadWriteMany volume in Kubernetes). A checkpoint is complete only when every
part its state lists is there in full (each part's meta.json, written last, gives every file's size):
the coordinator checks before it commits, and a resume only picks a complete checkpoint. A part that
the coordinator cannot see (the actor wrote it to a disk of its own) fails the save, naming the path.
Retention (trainer.max_checkpoints_to_keep) counts checkpoints in the order they were written, not by
step: a run resumed from an older step keeps what it has just written, and the newest is never pruned.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlfabric.core.errors import FailedPrecondition
from rlfabric.core.storage import fsync, fsync_tree

if TYPE_CHECKING:
    from rlfabric.actor.client import ActorInterface
    from rlfabric.critic.client import CriticInterface

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "coordinator.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(FailedPrecondition):
    """A checkpoint could not be written or read; the message says which and why (FAILED_PRECONDITION:
    the storage, not the request, has to change)."""


@dataclass
class CoordinatorState:
    """Everything besides the models that a resumed run needs to continue exactly."""

    step: int  # steps completed
    data_epoch: int
    data_position: int
    kl_coef: float
    weight_version: int
    run_id: str = ""
    saved_at: float = 0.0  # time.time() of the commit: retention keeps the newest written
    parts: list[str] = field(default_factory=list)  # the services' directories (e.g. actor, critic)


def final_model_dir(run_dir: str | Path) -> Path:
    """RUN_DIR/final_model: the policy a run keeps at its end, as a Hugging Face directory."""
    return Path(run_dir) / "final_model"


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
        if checkpoint_problem(path) is None:
            return path
    # The "latest" file is written last; fall back to the highest complete directory.
    complete = [p for p in root.glob("global_step_*") if _STEP_DIR.match(p.name) and checkpoint_problem(p) is None]
    return max(complete, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)


def part_problem(directory: Path) -> str | None:
    """Why a service's checkpoint directory is not complete here, or None when it is: its meta.json
    (written last) lists every other file with its size, and each must be there with that size."""
    try:
        files = json.loads((directory / "meta.json").read_text())["files"]
    except FileNotFoundError:
        return f"{directory} is missing" if not directory.exists() else f"{directory}/meta.json is missing"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{directory}/meta.json is unreadable: {type(error).__name__}: {error}"
    for name, size in files.items():
        try:
            found = (directory / name).stat().st_size
        except OSError:
            return f"{directory / name} is missing"
        if found != size:
            return f"{directory / name} has {found} bytes, not the {size} written"
    return None


def require_part_visible(role: str, directory: Path, run_dir: Path) -> None:
    """Raises CheckpointError unless the part `role` just wrote into `directory` is complete where the
    coordinator reads it: the error names the storage the role and the coordinator must share."""
    problem = part_problem(directory)
    if problem is not None:
        raise CheckpointError(
            f"the {role}'s part {directory.name} is not where the coordinator reads it ({problem}): "
            f"the {role} and the coordinator must share the run directory {run_dir} "
            "(in Kubernetes: one ReadWriteMany volume mounted by both)")


def checkpoint_problem(path: Path) -> str | None:
    """Why global_step_N is not a complete checkpoint, or None: the coordinator state and every part it lists."""
    try:
        state = read_state(path)
    except CheckpointError as error:
        return str(error)
    return next(filter(None, (part_problem(path / part) for part in state.parts)), None)


def require_complete(path: Path) -> None:
    """Raises CheckpointError, saying what is missing, unless `path` is a complete checkpoint."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"{path} is not a complete checkpoint: {problem}")


def read_state(path: str | Path) -> CoordinatorState:
    """The coordinator state of a checkpoint directory."""
    file = Path(path) / STATE_FILE
    try:
        return CoordinatorState(**json.loads(file.read_text()))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {STATE_FILE} is missing") from None
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{file} is unreadable: {error}") from None


async def write_checkpoint(run_dir: Path, state: CoordinatorState,
                           parts: Mapping[str, ActorInterface | CriticInterface], keep: int = 0) -> Path:
    """global_step_<state.step>: each of `parts` (name -> client) saves into its directory, side by side, then
    the state is committed (CheckpointWriter). A failure is a CheckpointError that says which checkpoint
    failed and what a resume will use; nothing of it is kept."""
    writer = CheckpointWriter(run_dir, keep=keep)
    tmp = writer.begin(state.step)
    try:
        await asyncio.gather(*(client.save_checkpoint(str(tmp / name)) for name, client in parts.items()))
        return await asyncio.to_thread(writer.commit, state)  # fsyncs: off the event loop
    except BaseException as error:
        writer.abort()
        if not isinstance(error, Exception) or isinstance(error, CheckpointError):
            raise
        # e.g. the actor's disk is full: say which checkpoint failed and what a resume will use.
        previous = latest_checkpoint(run_dir)
        raise CheckpointError(
            f"saving the checkpoint of step {state.step} failed; "
            f"{f'{previous} stays the resume point' if previous else 'there is no earlier checkpoint'}: "
            f"{type(error).__name__}: {error}") from error


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
        """Checks that every part in state.parts is complete in the temporary directory, then writes
        the state and moves the checkpoint into place; CheckpointError (and nothing kept) otherwise."""
        assert self.tmp is not None, "begin() first"
        final = step_dir(self.run_dir, self.step)
        for part in state.parts:
            try:
                require_part_visible(part, self.tmp / part, self.run_dir)
            except CheckpointError:
                self.abort()
                raise
        try:
            state.saved_at = time.time()
            (self.tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
            fsync_tree(self.tmp)
            if final.exists():  # a resumed run saving a step again: swap, then drop the old one
                old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            self.tmp.rename(final)
            self.tmp = None
            fsync(final.parent)
            latest_tmp = final.parent / f".{LATEST_FILE}.tmp"
            latest_tmp.write_text(str(self.step))
            fsync(latest_tmp)
            os.replace(latest_tmp, final.parent / LATEST_FILE)
            fsync(final.parent)
        except OSError as error:
            self.abort()
            raise CheckpointError(f"cannot write checkpoint {final}: {error}") from None
        self._prune(keep_path=final)
        return final

    def abort(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def _prune(self, keep_path: Path) -> None:
        """Removes the complete checkpoints beyond the `keep` most recently written; never keep_path."""
        if self.keep <= 0:
            return
        root = checkpoint_root(self.run_dir)
        complete = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and checkpoint_problem(p) is None]
        by_age = sorted(complete, key=_saved_at)
        for path in by_age[: -self.keep]:
            if path != keep_path:
                shutil.rmtree(path, ignore_errors=True)


def _saved_at(path: Path) -> float:
    """When a checkpoint was committed (its state's saved_at; the state file's mtime for older ones)."""
    try:
        return float(json.loads((path / STATE_FILE).read_text()).get("saved_at") or 0.0) or \
            (path / STATE_FILE).stat().st_mtime
    except (OSError, ValueError):
        return 0.0
