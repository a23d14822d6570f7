"""The run's checkpoint directory: atomic writes, the resume point, retention."""

import dataclasses
import time

import pytest
import torch
from safetensors.torch import load_file

from rlfabric.coordinator.checkpoints import (
    LATEST_FILE,
    CheckpointError,
    CheckpointWriter,
    CoordinatorState,
    checkpoint_root,
    latest_checkpoint,
    read_state,
    require_complete,
)
from rlfabric.trainer.checkpoint import Checkpoint, save_checkpoint


def state(step: int, parts=("actor",)) -> CoordinatorState:
    return CoordinatorState(step=step, data_epoch=0, data_position=4 * step, kl_coef=0.001, weight_version=step,
                            parts=list(parts))


def save_part(directory, step: int, role: str = "actor") -> None:
    """What the actor (or critic) service writes for its part, with the service's own checkpoint code."""
    save_checkpoint(str(directory), Checkpoint({"w": torch.full((step,), float(step))}, {}, {}, {"role": role}))


def save(run_dir, step: int, keep: int = 0):
    writer = CheckpointWriter(run_dir, keep=keep)
    tmp = writer.begin(step)
    save_part(tmp / "actor", step)
    return writer.commit(state(step))


def test_commit_makes_the_step_the_resume_point(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    assert path.name == "global_step_2"
    assert latest_checkpoint(tmp_path) == path
    assert dataclasses.replace(read_state(path), saved_at=0.0) == state(2)
    assert abs(read_state(path).saved_at - time.time()) < 60
    assert (checkpoint_root(tmp_path) / LATEST_FILE).read_text() == "2"
    assert not [p for p in checkpoint_root(tmp_path).iterdir() if p.name.startswith(".")]


def test_an_aborted_save_leaves_the_previous_checkpoint_as_the_resume_point(tmp_path):
    save(tmp_path, 1)
    writer = CheckpointWriter(tmp_path)
    tmp = writer.begin(2)
    (tmp / "actor").mkdir()
    writer.abort()  # e.g. the actor's SaveCheckpoint failed
    assert latest_checkpoint(tmp_path).name == "global_step_1"
    assert sorted(p.name for p in checkpoint_root(tmp_path).iterdir()) == ["global_step_1", LATEST_FILE]


def test_a_directory_without_state_is_not_a_checkpoint(tmp_path):
    save(tmp_path, 1)
    (checkpoint_root(tmp_path) / "global_step_5").mkdir()  # half-copied by hand
    (checkpoint_root(tmp_path) / LATEST_FILE).write_text("5")
    assert latest_checkpoint(tmp_path).name == "global_step_1"
    with pytest.raises(CheckpointError, match="coordinator.json is missing"):
        read_state(checkpoint_root(tmp_path) / "global_step_5")


def test_saving_a_step_again_replaces_it(tmp_path):
    save(tmp_path, 3)
    path = save(tmp_path, 3)
    assert load_file(path / "actor" / "model.safetensors")["w"].tolist() == [3.0, 3.0, 3.0]
    assert [p.name for p in checkpoint_root(tmp_path).iterdir() if p.name.startswith(".")] == []


def test_keep_prunes_the_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2)
    assert sorted(p.name for p in checkpoint_root(tmp_path).glob("global_step_*")) == ["global_step_3",
                                                                                      "global_step_4"]


def test_a_run_resumed_from_an_older_step_keeps_what_it_writes(tmp_path):
    """Retention counts checkpoints in the order they were written: a run resumed from step 10 after
    20 and 30 were written keeps its step-11 checkpoint (the newest), and `latest` names it."""
    for step in (10, 20, 30):
        save(tmp_path, step, keep=3)
    path = save(tmp_path, 11, keep=3)
    assert path.exists() and latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in checkpoint_root(tmp_path).glob("global_step_*")) == [
        "global_step_11", "global_step_20", "global_step_30"]  # the oldest written (10) went
    save(tmp_path, 12, keep=1)
    assert [p.name for p in checkpoint_root(tmp_path).glob("global_step_*")] == ["global_step_12"]


def test_an_unwritable_checkpoint_dir_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoints").write_text("not a directory")  # root ignores permissions; this fails for anyone
    with pytest.raises(CheckpointError, match="cannot write checkpoints under"):
        CheckpointWriter(tmp_path).begin(1)


def test_a_part_the_coordinator_cannot_see_fails_the_save(tmp_path):
    """The actor wrote its part on a disk of its own (a pod without the shared volume): the save fails,
    naming the storage requirement, and the previous checkpoint stays the resume point."""
    save(tmp_path, 1)
    writer = CheckpointWriter(tmp_path)
    writer.begin(2)  # the actor's SaveCheckpoint "succeeded" elsewhere: nothing arrived here
    with pytest.raises(CheckpointError, match="must share the run directory") as error:
        writer.commit(state(2))
    assert "actor" in str(error.value) and "is missing" in str(error.value)
    assert latest_checkpoint(tmp_path).name == "global_step_1"
    assert sorted(p.name for p in checkpoint_root(tmp_path).iterdir()) == ["global_step_1", LATEST_FILE]


def test_every_listed_part_must_be_complete(tmp_path):
    writer = CheckpointWriter(tmp_path)
    tmp = writer.begin(1)
    save_part(tmp / "actor", 1)  # the critic's part is missing
    with pytest.raises(CheckpointError, match="the critic's part critic is not where"):
        writer.commit(state(1, parts=("actor", "critic")))
    writer = CheckpointWriter(tmp_path)
    tmp = writer.begin(1)
    save_part(tmp / "actor", 1)
    save_part(tmp / "critic", 1, role="critic")
    assert writer.commit(state(1, parts=("actor", "critic"))) == latest_checkpoint(tmp_path)


def test_a_checkpoint_with_a_truncated_part_is_not_a_resume_point(tmp_path):
    """E.g. a file cut short by a copy between volumes or by a shared filesystem that lost a write."""
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    weights = path / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    assert latest_checkpoint(tmp_path).name == "global_step_1"
    with pytest.raises(CheckpointError, match="model.safetensors has .* bytes, not the"):
        require_complete(path)
    require_complete(latest_checkpoint(tmp_path))
