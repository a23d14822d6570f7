"""Test helpers: a trainer service served on loopback from a background event loop, batches in the
actor's layout, and a direct transformers forward to compare against."""

from __future__ import annotations

import asyncio
import tempfile
import threading

import torch

from rlfabric.actor.client import ActorClient
from rlfabric.core.config import RunConfig, config_from_dict
from rlfabric.core.server import RlfabricServer, ServerOptions
from rlfabric.critic.client import CriticClient
from rlfabric.reference.client import ReferenceClient
from rlfabric.serve import build_service

CLIENTS = {"actor": ActorClient, "reference": ReferenceClient, "critic": CriticClient}
PAD = 0  # the tiny tokenizer's pad token id


def make_config(model_path, n: int = 2, **sections) -> RunConfig:
    """A run config for the tiny model; sections: {"actor": {...}, "critic": {...}, ...}. The storage root
    is the temp folder, where the tests' checkpoint and export paths (tmp_path) lie."""
    tree = {"model": {"path": str(model_path)}, "rollout": {"n": n}, "storage": {"root": tempfile.gettempdir()}}
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return config_from_dict(tree)


class Served:
    """build_service(role) behind a real RlfabricServer on 127.0.0.1, driven from sync tests:
    `served.run(served.client.compute_log_probs(batch))`."""

    def __init__(self, role: str, config: RunConfig):
        self.service = build_service(role, config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = RlfabricServer(self.service, ServerOptions(port=0, metrics_port=None))
        self.run(self.server.start())
        self.address = f"127.0.0.1:{self.server.port}"
        self.client = self.run(self._client(CLIENTS[role]))

    async def _client(self, cls):
        return cls(self.address)

    def run(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.client.close())
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def make_batch(rows: int = 8, prompt_len: int = 7, response_len: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of varying lengths (every row keeps >= 1 of each)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 100, (rows, prompt_len), generator=g)
    responses = torch.randint(4, 100, (rows, response_len), generator=g)
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.int64)
    response_mask = torch.ones(rows, response_len, dtype=torch.int64)
    for i in range(rows):
        prompt_mask[i, : i % (prompt_len - 1)] = 0
        response_mask[i, max(1, response_len - i % response_len) :] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, PAD)
    responses = responses.masked_fill(response_mask == 0, PAD)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "responses": responses,
        "response_mask": response_mask,
    }


def hf_log_probs(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """log p(response token) from a plain transformers forward: positions count real tokens only, as
    in generate(); logits / temperature, in float32 or the model's wider dtype; 0 on response padding. [B, T]"""
    mask = batch["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    response_len = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids).logits
    logits = logits[:, -response_len - 1 : -1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [B, T, vocab]
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return log_probs * batch["response_mask"]
