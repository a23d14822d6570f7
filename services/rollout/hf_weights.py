"""The hf engine's model weights changed in place (rlfabric.rollout.hf_engine decides when: between batches).

- copy_weights: a new version's tensors into the model's parameters, all or none; tensors nobody else holds
  may become the parameters themselves (adopted) instead of being copied.
- discard_weights / restore_weights: sleep level 2 frees every parameter's memory, as vLLM's level 2 does;
  after WakeUp the parameters have their shapes back, holding garbage until the next weight sync fills them.
"""

from __future__ import annotations

import torch

from rlfabric.core.errors import InvalidArgument


def copy_weights(named: list[tuple[str, torch.Tensor]], targets: dict[str, torch.Tensor], model: str,
                 device: torch.device, adopt: bool = False) -> bool:
    """Checks every tensor against `targets` (the model's tensors by name) first, then copies all of them: a bad
    update changes nothing. With `adopt` (tensors nobody else holds) and every tensor in its parameter's dtype
    and device, each parameter takes the tensor itself instead (returns True). Copies on the host run on this
    thread alone: they are memory-bound, and OpenMP's threads only wait for each other
    (pipeline.one_thread_on_the_host)."""
    from rlfabric.weight_sync.pipeline import one_thread_on_the_host

    for name, tensor in named:
        if name not in targets:
            raise InvalidArgument(f"unknown weight {name!r} for model {model}")
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise InvalidArgument(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the model's is {tuple(targets[name].shape)}")
    adopt = adopt and all(t.dtype == targets[n].dtype and t.device == targets[n].device for n, t in named)
    with torch.no_grad(), one_thread_on_the_host(device):
        for name, tensor in named:
            if adopt:
                targets[name].data = tensor
            else:
                targets[name].copy_(tensor)  # casts and moves on the way
    return adopt


def discard_weights(net: torch.nn.Module) -> dict[torch.nn.Parameter, torch.Size]:
    """Each parameter (a tied one once) keeps its object and shape, over no memory; returns the real shapes.
    Buffers (rotary tables) stay, as no sync sends them."""
    shapes = {}
    for parameter in net.parameters():
        shapes[parameter] = parameter.shape
        parameter.data = parameter.data.new_empty(0)
    return shapes


def restore_weights(shapes: dict[torch.nn.Parameter, torch.Size]) -> None:
    """Gives each discarded parameter memory of its shape again (uninitialised)."""
    for parameter, shape in shapes.items():
        parameter.data = parameter.data.new_empty(shape)
