"""Checkpoints and Hugging Face exports, written into a temporary sibling directory and renamed into
place, so a failed or interrupted write leaves the previous directory as it was.

A checkpoint directory:
    model.safetensors   full weights under Hugging Face names (float32 master weights of trained roles)
    optimizer.pt        full AdamW state keyed by parameter name (torch.save; loaded with weights_only)
    trainer_state.pt    update and optimizer-step counters, the torch RNG state of every rank
    meta.json           role, model, world size, counters, tied-weight aliases, format version, and
                        the size of every other file: written last, it is what makes the part complete
                        for a reader on another machine (rlfabric.coordinator.checkpoints.part_problem)
Full (gathered) state dicts make a checkpoint independent of the world size: it loads into any number
of ranks (the RNG states are restored only into the same world size).
"""

from __future__ import annotations

import copy
import json
import pickle  # only for its UnpicklingError: torch.load(weights_only=True) raises it on pickle payloads
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlfabric.core.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfabric.core.moe import checkpoint_weights, expert_layout
from rlfabric.core.storage import disk_full, fsync, fsync_tree

FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
EXPORT_MARKER = ".rlfabric-export.json"  # in every ExportHF directory: what marks it as ours to replace


@dataclass
class Checkpoint:
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    trainer_state: dict  # {"updates", "optimizer_steps", "rng": [per-rank dict of tensors]}
    meta: dict


def _target(path: str) -> Path:
    if not path:
        raise InvalidArgument("the directory path is empty")
    return Path(path).expanduser()


def is_checkpoint(directory: Path) -> bool:
    """An rlfabric checkpoint directory (meta.json naming the role that wrote it)."""
    try:
        return "role" in json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def is_export(directory: Path) -> bool:
    return (directory / EXPORT_MARKER).is_file()


def write_atomically(path: str, write: Callable[[Path], None], replaceable: Callable[[Path], bool]) -> int:
    """Runs write(tmp_dir), then swaps tmp_dir in for `path`; returns the bytes written.

    An existing `path` is replaced only when it is empty or `replaceable` says it is what this write
    makes (an rlfabric checkpoint, an rlfabric export): anything else there is the user's, and the
    write is FAILED_PRECONDITION with nothing touched."""
    target = _target(path)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise FailedPrecondition(f"{target} exists and is not a directory; refusing to replace it")
    if target.is_dir() and any(target.iterdir()) and not replaceable(target):
        raise FailedPrecondition(f"{target} exists and is not an rlfabric directory of this kind; refusing to "
                                 "replace it (choose a new path, or remove it yourself)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        full = None
        try:
            write(tmp)
            fsync_tree(tmp)  # on disk before it takes the name: a crash leaves the old one or the new one
            num_bytes = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            if target.exists():
                target.rename(old)
            tmp.rename(target)
            fsync(target.parent)
        except BaseException as error:
            # Asked before the partial write is removed and frees its space.
            full = disk_full(target, error) if isinstance(error, Exception) else None
            shutil.rmtree(tmp, ignore_errors=True)
            if full is None:
                raise
        if full is not None:
            # Raised here, not from the writer's error: that one holds the writer, whose open file (removed but
            # open: torch's) keeps the disk full for as long as the error lives.
            raise full
        shutil.rmtree(old, ignore_errors=True)
        return num_bytes
    except OSError as error:
        raise disk_full(target, error) or FailedPrecondition(f"cannot write {target}: {error}") from error


def _split_aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tied weights (e.g. lm_head = embed_tokens) share memory, which safetensors refuses: keep one
    name per storage and return {alias: kept name}."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = tensor.contiguous()
    return unique, aliases


def save_checkpoint(path: str, checkpoint: Checkpoint) -> int:
    weights, aliases = _split_aliases(checkpoint.model_state)
    meta = {**checkpoint.meta, "aliases": aliases, "format_version": FORMAT_VERSION}

    def write(directory: Path) -> None:
        save_file(weights, directory / WEIGHTS, metadata={"format": "pt"})
        torch.save(checkpoint.optimizer_state, directory / "optimizer.pt")
        torch.save(checkpoint.trainer_state, directory / "trainer_state.pt")
        files = {f.name: f.stat().st_size for f in sorted(directory.iterdir())}
        (directory / "meta.json").write_text(json.dumps({**meta, "files": files}, indent=2))

    return write_atomically(path, write, replaceable=is_checkpoint)


def load_checkpoint(path: str, role: str) -> Checkpoint:
    directory = _target(path)
    meta_file = directory / "meta.json"
    if not meta_file.is_file():
        raise NotFound(f"no checkpoint at {directory} (meta.json missing)")
    try:
        meta = json.loads(meta_file.read_text())
        if meta.get("role") != role:
            raise InvalidArgument(f"checkpoint {directory} was written by the {meta.get('role')} service, not the {role}")
        if meta.get("format_version") != FORMAT_VERSION:
            raise InvalidArgument(f"checkpoint {directory} has format {meta.get('format_version')}, "
                                  f"this service reads {FORMAT_VERSION}")
        weights = load_file(directory / WEIGHTS)
        for alias, name in meta.get("aliases", {}).items():
            weights[alias] = weights[name]
        optimizer_state = torch.load(directory / "optimizer.pt", weights_only=True)
        trainer_state = torch.load(directory / "trainer_state.pt", weights_only=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as error:
        if isinstance(error, InvalidArgument):
            raise
        raise FailedPrecondition(f"cannot read checkpoint {directory}: {type(error).__name__}: {error}") from error
    return Checkpoint(weights, optimizer_state, trainer_state, meta)


def export_hf(path: str, model_state: dict[str, torch.Tensor], hf_config, source: str,
              also: Callable[[Path], None] | None = None) -> int:
    """A directory AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load as is:
    config.json, model.safetensors (tied duplicates left out, as save_pretrained does; a mixture-of-experts
    model's experts one matrix each, under the checkpoint names save_pretrained writes), and every other
    file of the source model directory (tokenizer, chat template, generation config, custom code)
    copied byte for byte."""
    weights, _aliases = _split_aliases(model_state)
    if expert_layout(hf_config) is not None:  # the per-expert matrices are views of the fused tensors
        weights = {name: tensor.clone() for name, tensor in checkpoint_weights(hf_config, weights).items()}
    config = copy.deepcopy(hf_config)
    config.use_cache = True  # the service turns the KV cache off for training; generation wants it
    extras = [f for f in Path(source).iterdir()
              if f.is_file() and not _is_weights_or_config(f.name) and f.name != EXPORT_MARKER]

    def write(directory: Path) -> None:
        config.save_pretrained(directory)
        save_file(weights, directory / WEIGHTS, metadata={"format": "pt"})
        for extra in extras:
            shutil.copy(extra, directory / extra.name)
        if also is not None:  # e.g. the LoRA adapter alone, in adapter/
            also(directory)
        (directory / EXPORT_MARKER).write_text(json.dumps({"kind": "hf-export", "source": str(source)}))

    return write_atomically(path, write, replaceable=is_export)


def _is_weights_or_config(name: str) -> bool:
    return name == "config.json" or name.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json"))
