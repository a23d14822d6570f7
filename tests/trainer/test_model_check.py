"""A model directory the mesh cannot use is a clear error at start, naming the path: not a causal LM,
a tokenizer without a chat template, a vocabulary that does not fit the model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from rlfabric.trainer.models import check_policy_model


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    return copy


def edit_json(path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_the_tiny_model_passes(tiny_model):
    check_policy_model(str(tiny_model))


def test_a_model_that_is_not_a_causal_lm_is_named(model_copy):
    edit_json(model_copy / "config.json", architectures=["Qwen2ForSequenceClassification"])
    with pytest.raises(ValueError, match=rf"model.path {model_copy} holds a Qwen2ForSequenceClassification .*not a "
                                         r"causal language model"):
        check_policy_model(str(model_copy))


def test_a_tokenizer_without_a_chat_template_is_named(model_copy):
    edit_json(model_copy / "tokenizer_config.json", chat_template=None)
    (model_copy / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=rf"model.path {model_copy}: the tokenizer has no chat template"):
        check_policy_model(str(model_copy))


def test_a_vocabulary_larger_than_the_embedding_is_named(model_copy):
    edit_json(model_copy / "config.json", vocab_size=50)
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens but the model's embedding only 50 rows"):
        check_policy_model(str(model_copy))


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="no config.json there"):
        check_policy_model(str(tmp_path))


@pytest.mark.slow  # runs the CLI
def test_rlfabric_up_refuses_before_starting_any_service(model_copy, tmp_path):
    edit_json(model_copy / "config.json", architectures=["Qwen2ForTokenClassification"])
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rlfabric", "up", f"model.path={model_copy}", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"model.path {model_copy} holds a Qwen2ForTokenClassification" in done.stderr
    assert not (run_dir / "endpoints.json").exists() and not list((run_dir / "logs").glob("*.log"))
