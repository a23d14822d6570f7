"""One batch of the hf engine on the device: its rows' KV cache and sampling state, and the moves of a
decode loop that keeps the host out of the per-token path.

`DecodeBatch.prefill` runs the prompts; `sample` then samples up to k tokens a row, feeding each but the
last back, with no host sync (each token's random number comes from (row seed, position) on the device);
the engine reads the tokens once per `sample`, then `select`s the rows going on, `feed`s them their last
token, and may `join` rows that were prefilled meanwhile (continuous batching: a request that arrives
while a batch runs starts within k steps instead of waiting for the batch to end).

Rows are left-padded: a row's mask is 0 over its padding, and its position ids count its real tokens only,
so a row's logits do not depend on how much padding the others give it. Prompts that begin alike (a chat
template's system turn, a judge's instructions) prefill their common prefix once (share_prefix): its cache is
repeated for every prompt and the rest of each prompt runs after it, padded between the two, so a batch's
prefill costs its prefix once instead of once a prompt; where the prefill is compute-bound (a CPU), that is
most of what batching saves.

With a RouteRecorder (MoE routing replay), `routes` keeps the experts each MoE layer chose for every token
that went through the model, aligned with `mask` (-1 on padding): a row's real columns are its prompt's
and its fed tokens' routes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rlfabric.core.router_replay import RouteRecorder
from rlfabric.rollout.sampling import counter_uniforms, sample_tokens
from rlfabric.rollout.types import SamplingSpec


@dataclass
class DecodeBatch:
    """The rows of a batch on the device, one entry a row (B); W is the cache's length."""

    net: torch.nn.Module
    cache: object  # transformers DynamicCache
    logits: torch.Tensor  # (B, V) of each row's next token
    mask: torch.Tensor  # (B, W) 1 = a real token, 0 = left padding
    next_pos: torch.Tensor  # (B,) position id of each row's next token
    temperature: torch.Tensor  # (B,)
    top_k: torch.Tensor  # (B,)
    top_p: torch.Tensor  # (B,)
    seeds: torch.Tensor  # (B,) int64 row seeds (types.row_seed)
    filters: bool  # some sampled row uses top-k or top-p (known on the host, so sampling needs no sync)
    recorder: RouteRecorder | None = None
    routes: torch.Tensor | None = None  # (B, W', layers, top_k) int16 expert ids, -1 on padding (with recorder)
    route_steps: list[torch.Tensor] = field(default_factory=list)  # [(B, layers, top_k)] of the fed tokens since
    #   routes was last joined to them (W' + len(route_steps) = W): no copy of the whole history per step

    @classmethod
    def prefill(cls, net, prompts: list[list[int]], expand: list[int], params: Sequence[SamplingSpec],
                seeds: Sequence[int], pad: int, recorder: RouteRecorder | None = None,
                share_prefix: bool = True) -> DecodeBatch:
        """Runs each of `prompts` once (left-padded; their common prefix once, with share_prefix) and repeats
        its cache for its rows: row i is prompt expand[i], sampled with params[i] and seeds[i]."""
        from transformers import DynamicCache

        device = net.device
        cache = DynamicCache(config=net.config)
        # Routes are recorded for the batch's (U, W) tokens in one pass: with a recorder the prefix is not shared.
        shared = shared_prefix(prompts) if share_prefix and recorder is None and _plain(cache) else 0
        if shared:
            net(input_ids=torch.tensor([prompts[0][:shared]], device=device), past_key_values=cache, use_cache=True,
                logits_to_keep=1)
            cache.batch_repeat_interleave(len(prompts))
        rests = [p[shared:] for p in prompts]
        width = max(map(len, rests))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rests], device=device)  # (U, W - shared)
        mask = torch.tensor([[1] * shared + [0] * (width - len(p)) + [1] * len(p) for p in rests],
                            device=device)  # (U, W)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (U, W)
        out = net(input_ids=input_ids, attention_mask=mask, position_ids=positions[:, shared:],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
        rows = torch.tensor(expand, device=device)  # (B,)
        cache.batch_select_indices(rows)
        routes = None
        if recorder is not None:
            routes = recorder.take().to(torch.int16).unflatten(0, mask.shape)  # (U, W, layers, top_k)
            routes = routes.masked_fill(~mask.bool()[:, :, None, None], -1)[rows]
        return cls(
            net=net, cache=cache, logits=out.logits[:, -1, :][rows], mask=mask[rows], next_pos=positions[rows, -1] + 1,
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            seeds=torch.tensor(list(seeds), dtype=torch.int64, device=device),
            filters=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params),
            recorder=recorder, routes=routes,
        )

    def __len__(self) -> int:
        return len(self.seeds)

    def sample(self, generated: Sequence[int], steps: int, interrupted: Callable[[], bool],
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `steps` tokens a row (fewer when interrupted() turns true), feeding each but the last
        back, with no host sync. generated: how many tokens each row has so far (the position of its next
        token in its response, which keys the token's random number).
        Returns the tokens (B, k) int64 and their log-probs (B, k) float32, k <= steps."""
        device = self.seeds.device
        first = torch.tensor(list(generated), device=device)  # (B,)
        uniforms = counter_uniforms(self.seeds, first[:, None] + torch.arange(steps, device=device))  # (B, steps)
        tokens, logprobs = [], []
        for step in range(steps):
            token, logprob = sample_tokens(self.logits, self.temperature, self.top_k, self.top_p, uniforms[:, step],
                                           filters=self.filters)
            tokens.append(token)
            logprobs.append(logprob)
            if step == steps - 1 or interrupted():
                break
            self.feed(token)
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)

    def feed(self, tokens: torch.Tensor) -> None:
        """Runs one token a row (B,) through the model; its logits become the rows' next."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)  # (B, W + 1)
        out = self.net(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.next_pos[:, None],
                       past_key_values=self.cache, use_cache=True)
        self.logits, self.next_pos = out.logits[:, -1, :], self.next_pos + 1
        if self.recorder is not None:
            self.route_steps.append(self.recorder.take().to(torch.int16))

    def _all_routes(self) -> torch.Tensor:
        """(B, W, layers, top_k): routes with the fed tokens' joined on."""
        if self.route_steps:
            self.routes = torch.cat([self.routes, torch.stack(self.route_steps, dim=1)], dim=1)
            self.route_steps = []
        return self.routes

    def row_routes(self, row: int, tokens: int) -> torch.Tensor:
        """(tokens, layers, top_k) int16 routes of the row's first `tokens` real tokens (prompt, then
        response), -1 for those never run through the model (its last sampled token)."""
        real = self._all_routes()[row][self.mask[row].bool()][:tokens]
        return F.pad(real, (0, 0, 0, 0, 0, tokens - len(real)), value=-1)

    def select(self, keep: torch.Tensor) -> None:
        """Keeps the rows `keep` (indices on the device, in that order)."""
        self.cache.batch_select_indices(keep)
        for name in ("logits", "mask", "next_pos", "temperature", "top_k", "top_p", "seeds"):
            setattr(self, name, getattr(self, name)[keep])
        if self.routes is not None:
            self.routes = self._all_routes()[keep]

    def can_join(self) -> bool:
        """Whether other rows can join: every cache layer a plain growing one (not a sliding window, whose
        layers keep their own offsets), so joining is left-padding and concatenating."""
        return _plain(self.cache)

    def join(self, other: DecodeBatch) -> None:
        """Appends other's rows (same model, both at "sample next"): the shorter cache is left-padded."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.mask = torch.cat([F.pad(self.mask, (width - self.mask.shape[1], 0)),
                               F.pad(other.mask, (width - other.mask.shape[1], 0))])
        if self.routes is not None:
            self.routes = torch.cat([F.pad(routes, (0, 0, 0, 0, width - routes.shape[1], 0), value=-1)
                                     for routes in (self._all_routes(), other._all_routes())])
        for name in ("logits", "next_pos", "temperature", "top_k", "top_p", "seeds"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.filters = self.filters or other.filters


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all of two or more prompts have in common, leaving each at least one of its own
    (whose logits are the row's next); 0 for a single prompt."""
    if len(prompts) < 2:
        return 0
    limit = min(map(len, prompts)) - 1
    first = prompts[0]
    for position in range(limit):
        token = first[position]
        if any(p[position] != token for p in prompts):
            return position
    return max(limit, 0)


def _plain(cache) -> bool:
    """Every layer of the cache a plain growing one (a sliding window's layers keep their own offsets)."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _left_pad(states: torch.Tensor, width: int) -> torch.Tensor:
    """Cached keys or values (B, H, T, D) left-padded with zeros to T = width (masked out: never attended)."""
    return F.pad(states, (0, 0, width - states.shape[-2], 0))
