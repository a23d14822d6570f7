"""SaveCheckpoint / LoadCheckpoint (bit-exact resume, atomic writes) and ExportHF."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlfabric.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from rlfabric.trainer import checkpoint as ckpt
from tests.numerics import FLOAT64, assert_same_float32
from tests.trainer.helpers import Served, hf_log_probs, make_batch, make_config

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # numerics: make test-kernels

CONFIG = {"lr": 3e-3, "ppo_mini_batch_size": 2, "lr_warmup_steps": 3}


def _update(served, batch, seed):
    g = torch.Generator().manual_seed(seed)
    old = served.run(served.client.compute_log_probs(batch))["log_probs"]
    advantages = torch.randn(batch["responses"].shape, generator=g)
    return served.run(served.client.update_policy({**batch, "old_log_probs": old + 0.01, "advantages": advantages}))


def _saved_state(path):
    return load_file(path / "model.safetensors"), torch.load(path / "optimizer.pt", weights_only=True)


def test_resume_from_checkpoint_equals_uninterrupted_training(tiny_model, tmp_path):
    config = make_config(tiny_model, actor=CONFIG)
    batch = make_batch(rows=8)
    with Served("actor", config) as served:
        _update(served, batch, seed=0)
        assert served.run(served.client.save_checkpoint(tmp_path / "step1")) > 0
        uninterrupted = [_update(served, batch, seed=s) for s in (1, 2)]
        served.run(served.client.save_checkpoint(tmp_path / "end-a"))
    with Served("actor", config) as resumed:
        assert resumed.run(resumed.client.load_checkpoint(tmp_path / "step1")) == 2
        again = [_update(resumed, batch, seed=s) for s in (1, 2)]
        resumed.run(resumed.client.save_checkpoint(tmp_path / "end-b"))
        assert resumed.run(resumed.client.get_status()).optimizer_step == 6
    for a, b in zip(uninterrupted, again, strict=True):
        assert _training_metrics(a) == _training_metrics(b)
    weights_a, optimizer_a = _saved_state(tmp_path / "end-a")
    weights_b, optimizer_b = _saved_state(tmp_path / "end-b")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    for name, state in optimizer_a["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(optimizer_b["state"][name][k])) for k, v in state.items())


def test_a_save_before_the_first_update_changes_no_update(tiny_model, tmp_path):
    """torch fills a never-stepped AdamW's state by a zero-gradient step that counts as step 1; a fresh run's
    initial save must not make its first update a bias-corrected step 2 (0.74 of its size), nor must a run
    resumed from that checkpoint."""
    config = make_config(tiny_model, actor=CONFIG)
    batch = make_batch(rows=8)
    runs = {}
    for name in ("no save", "saved first", "resumed"):
        with Served("actor", config) as served:
            if name == "saved first":
                served.run(served.client.save_checkpoint(tmp_path / "start"))
            if name == "resumed":
                assert served.run(served.client.load_checkpoint(tmp_path / "start")) == 0
            runs[name] = [_training_metrics(_update(served, batch, seed=s)) for s in (0, 1)]
            served.run(served.client.save_checkpoint(tmp_path / name))
    assert runs["saved first"] == runs["no save"] == runs["resumed"]
    ends = {name: _saved_state(tmp_path / name) for name in runs}
    for name in ("saved first", "resumed"):
        assert all(torch.equal(ends[name][0][k], v) for k, v in ends["no save"][0].items()), name
        steps = {float(torch.as_tensor(state["step"])) for state in ends[name][1]["state"].values()}
        assert steps == {4.0}, name  # two updates of two optimizer steps each (8 rows, mini-batches of 4)
    start_steps = {float(torch.as_tensor(s["step"])) for s in _saved_state(tmp_path / "start")[1]["state"].values()}
    assert start_steps == {0.0}


def test_failed_save_keeps_the_previous_checkpoint(tiny_model, tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    with Served("critic", make_config(tiny_model, critic=CONFIG)) as served:
        served.run(served.client.save_checkpoint(target))
        before = (target / "model.safetensors").read_bytes()
        batch = make_batch(rows=4)
        values = served.run(served.client.compute_values(batch))["values"]
        served.run(served.client.update_values({**batch, "values": values, "returns": values + 1}))

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ckpt, "save_file", disk_full)
        with pytest.raises(ResourceExhausted, match="No space left"):
            served.run(served.client.save_checkpoint(target))
        monkeypatch.undo()
        assert (target / "model.safetensors").read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left behind
        assert served.run(served.client.load_checkpoint(target)) == 0
        with pytest.raises(NotFound, match="no checkpoint"):
            served.run(served.client.load_checkpoint(tmp_path / "missing"))
        after_load = served.run(served.client.compute_values(batch))["values"]
    torch.testing.assert_close(after_load, values, atol=0, rtol=0)


def test_checkpoint_of_another_role_is_rejected(tiny_model, tmp_path):
    with Served("critic", make_config(tiny_model)) as critic:
        critic.run(critic.client.save_checkpoint(tmp_path / "critic"))
    with Served("actor", make_config(tiny_model)) as actor:
        with pytest.raises(InvalidArgument, match="written by the critic"):
            actor.run(actor.client.load_checkpoint(tmp_path / "critic"))
        assert actor.run(actor.client.get_status()).optimizer_step == 0


def test_export_hf_loads_with_transformers_and_gives_the_same_logits(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    batch = make_batch(rows=6, seed=4)
    config = make_config(tiny_model, actor={"lr": 1e-2, "ppo_mini_batch_size": 3}, model=FLOAT64)
    with Served("actor", config) as served:
        _update(served, batch, seed=0)
        service_log_probs = served.run(served.client.compute_log_probs(batch, temperature=0.6))["log_probs"]
        assert served.run(served.client.export_hf(tmp_path / "hf")) > 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    original = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).eval()
    assert_same_float32(hf_log_probs(exported, batch, 0.6), service_log_probs)  # float64 both: tests/numerics.py
    assert not torch.allclose(hf_log_probs(original, batch, 0.6).float(), service_log_probs, atol=1e-3)  # it trained
    text = "2 + 2 = 4"
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text) == AutoTokenizer.from_pretrained(tiny_model)(text)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert exported.config.use_cache


def test_a_write_never_replaces_a_directory_that_is_not_its_own(tiny_model, tmp_path):
    """ExportHF and SaveCheckpoint replace only an rlfabric export / checkpoint (or an empty
    directory); a user's directory at that path is FAILED_PRECONDITION and stays byte for byte."""
    projects = tmp_path / "projects"
    (projects / "src").mkdir(parents=True)
    (projects / "src" / "main.py").write_text("print('mine')\n")
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    (tmp_path / "empty").mkdir()
    with Served("actor", make_config(tiny_model)) as served:
        for call in (served.client.export_hf, served.client.save_checkpoint):
            with pytest.raises(FailedPrecondition, match="is not an rlfabric directory of this kind"):
                served.run(call(projects))
            with pytest.raises(FailedPrecondition, match="is not a directory"):
                served.run(call(tmp_path / "notes.txt"))
        assert (projects / "src" / "main.py").read_text() == "print('mine')\n"
        assert sorted(p.name for p in projects.rglob("*")) == ["main.py", "src"]
        assert (tmp_path / "notes.txt").read_text() == "a file, not a directory"

        # Its own kind is replaced (a re-export, a re-saved checkpoint), an empty directory is used,
        # and one kind never replaces the other.
        served.run(served.client.export_hf(tmp_path / "empty"))
        served.run(served.client.export_hf(tmp_path / "empty"))
        served.run(served.client.save_checkpoint(tmp_path / "ckpt"))
        served.run(served.client.save_checkpoint(tmp_path / "ckpt"))
        with pytest.raises(FailedPrecondition):
            served.run(served.client.save_checkpoint(tmp_path / "empty"))
        with pytest.raises(FailedPrecondition):
            served.run(served.client.export_hf(tmp_path / "ckpt"))
        assert served.run(served.client.load_checkpoint(tmp_path / "ckpt")) == 0
    assert ckpt.is_export(tmp_path / "empty") and ckpt.is_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "empty", "notes.txt", "projects"]


def _training_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """An update's metrics without its timings and the process's memory, which no two runs share."""
    return {k: v for k, v in metrics.items() if not k.endswith("_s") and not k.startswith("memory/")}
