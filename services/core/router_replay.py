"""MoE routing replay (actor.router_replay, "R3"): the rollout engine records the experts each MoE layer chose
for each token, and the actor's forward passes route every token to those experts instead of choosing again.

Why: the rollout engine (bf16, its own kernels) and the trainer (float32, another summation order) compute
slightly different router logits, and where two experts are nearly tied the top-k differs: the trainer then
evaluates, and trains, a different network than the one that sampled. Replaying the routes removes that
source of the rollout/trainer mismatch; the routing weights stay the trainer's (softmax of its own router
logits at the replayed experts), so the router still gets a gradient.

The routers are transformers 5's TopKRouter modules of the sparse MoE blocks (Qwen2/3-MoE, Mixtral,
...): forward(hidden [N, H]) -> (router_logits [N, E], routing weights [N, K], expert ids [N, K]). Both
sides hook them in module order (layer order), so the l-th router of the rollout's model is the l-th of the
trainer's. Forward hooks, not patched classes: recording reads the ids; replay replaces the weights and ids
of the router's output, and the experts module runs on those as it would on its own.

Layout: routes [tokens, layers, top_k] of small unsigned ints on a sample (rlfabric.rollout.routes, numpy only,
for the wire), and in the trainer's batch int64 with -1 where a token has none (padding, a response's last token).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from rlfabric.core.errors import InvalidArgument


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of a transformers model, in layer order (empty for a dense model)."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


class RouteRecorder:
    """Forward hooks that keep each router's expert ids of the latest forward pass.

        with RouteRecorder(model) as recorder:   # or recorder.attach() ... recorder.detach()
            model(...)
            routes = recorder.take()   # [tokens of that pass, layers, top_k] int64, on the model's device
    """

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router (a TopKRouter module) to record")
        self._ids: list[torch.Tensor | None] = [None] * len(self.routers)
        self._hooks: list = []

    def attach(self) -> RouteRecorder:
        """Hooks the routers (until detach)."""
        if not self._hooks:
            self._hooks = [router.register_forward_hook(self._keeper(layer)) for layer, router in enumerate(self.routers)]
        return self

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> RouteRecorder:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _keeper(self, layer: int):
        def keep(_router, _args, output):
            self._ids[layer] = output[2]

        return keep

    def take(self) -> torch.Tensor:
        """[tokens, layers, top_k] int64 of the latest pass (every router ran in it)."""
        if any(ids is None for ids in self._ids):
            raise RuntimeError("a router did not run in the recorded forward pass")
        routes = torch.stack(self._ids, dim=1)  # type: ignore[arg-type]
        self._ids = [None] * len(self.routers)
        return routes


@dataclass
class Agreement:
    """How many recorded (token, layer) routes the trainer would have chosen itself (the same set of experts)."""

    matched: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, of its latest pass (0-dim)
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)

    def totals(self) -> tuple[int, int]:
        """(matched, recorded) over the layers (one host sync)."""
        if not self.recorded:
            return 0, 0
        both = torch.stack([torch.stack(list(self.matched.values())), torch.stack(list(self.recorded.values()))])
        matched, recorded = both.sum(1).tolist()
        return int(matched), int(recorded)


@contextlib.contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor) -> Iterator[Agreement]:
    """Every router of `model` uses `routes` [tokens, layers, top_k] int64 (-1 = choose itself) for the
    forward passes inside, whose tokens are routes' tokens in order (a [B, S] batch flattened): the
    expert ids replace its own, and the routing weights are its softmax at those ids, renormalised when the
    router renormalises its own top-k (Qwen3-MoE's norm_topk_prob; Mixtral always). Keep the context open
    over the backward pass too: gradient checkpointing runs the forward again there.
    Yields the Agreement of the latest pass through each layer."""
    layers = routers(model)
    if routes.dim() != 3 or routes.shape[1] != len(layers):
        raise InvalidArgument(f"routed_experts has shape {list(routes.shape)} but the model has {len(layers)} MoE "
                              "layers: [tokens, layers, top_k] expected")
    experts = layers[0].num_experts
    if routes.numel() and int(routes.max()) >= experts:  # one host sync per micro-batch
        raise InvalidArgument(f"routed_experts holds expert id {int(routes.max())}; the model's routers choose among "
                              f"{experts} experts")
    agreement = Agreement()
    hooks = [router.register_forward_hook(_replayer(layer, router, routes, agreement))
             for layer, router in enumerate(layers)]
    try:
        yield agreement
    finally:
        for hook in hooks:
            hook.remove()


def _replayer(layer: int, router: nn.Module, routes: torch.Tensor, agreement: Agreement):
    top_k = router.top_k
    if routes.shape[2] != top_k:
        raise InvalidArgument(f"routed_experts has top_k {routes.shape[2]} but the model's routers choose {top_k}")
    renormalise = getattr(router, "norm_topk_prob", True)

    def replay(_router, _args, output):
        logits, weights, own = output
        given = routes[:, layer].to(own.device)  # [N, K]
        if given.shape[0] != own.shape[0]:
            raise InvalidArgument(f"routed_experts has {given.shape[0]} tokens but the forward pass runs "
                                  f"{own.shape[0]}")
        recorded = (given >= 0).all(-1, keepdim=True)  # [N, 1]
        ids = torch.where(recorded, given, own)
        same = (ids.sort(-1).values == own.sort(-1).values).all(-1) & recorded[:, 0]
        agreement.matched[layer] = same.sum()  # no host sync here: Agreement.totals reads them once
        agreement.recorded[layer] = recorded.sum()
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, ids)  # [N, K]
        if renormalise:
            probs = probs / probs.sum(-1, keepdim=True)
        return logits, probs.to(weights.dtype), ids

    return replay
