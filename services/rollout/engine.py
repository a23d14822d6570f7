"""The rollout engine interface, shared by the hf, vLLM and SGLang engines.

The servicer turns protos into the domain types of rlfabric.rollout.types, awaits the engine and
turns results back into protos; engines never see a proto. `RolloutEngine.generate` validates every
request against the engine's limits (one place for the INVALID_ARGUMENT rules) before handing it
to the engine's `_generate`.
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING

from rlfabric.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unimplemented
from rlfabric.core.weight_sync import Manifest, Membership, SyncGroup, WeightLimits, WeightSwap
from rlfabric.rollout.types import EngineLimits, EngineStatus, FinishedSample, SamplingSpec, validate_request

if TYPE_CHECKING:
    import torch


class RolloutEngine(abc.ABC):
    """An inference engine behind the rollout service.

    Lifecycle: start() loads the model (the server reports ready after it), stop() releases it.
    generate() yields each finished sample once, as soon as it finishes; cancelling the iteration
    aborts the request's unfinished samples.
    """

    name: str = ""

    def __init__(self, model: str):
        self.model = model
        self.limits: EngineLimits | None = None
        self.tokenizer = None  # a Hugging Face tokenizer, for chat templates and text
        self.weight_sync = Membership(limits=self.weight_limits)  # the actor's weight-sync group, when joined
        self._checkpoint_limits: tuple[WeightLimits | None] | None = None
        self.max_rows_per_request = 4096  # prompts x n of one request; rollout.max_rows_per_request

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def status(self) -> EngineStatus:
        """Cheap and synchronous (metrics gauges read it at scrape time)."""

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingSpec) -> AsyncIterator[FinishedSample]:
        """Validates, then yields every (prompt, sample) once, in the order they finish."""
        if self.limits is None:
            raise FailedPrecondition(f"{self.name} engine has not started")
        validate_request(prompts, params, self.limits)
        if len(prompts) * params.n > self.max_rows_per_request:
            raise ResourceExhausted(f"{len(prompts)} prompts x n={params.n} = {len(prompts) * params.n} samples in "
                                    f"one request; this replica takes at most {self.max_rows_per_request} "
                                    "(rollout.max_rows_per_request): split the request")
        async for sample in self._generate([list(map(int, p)) for p in prompts], params):
            yield sample

    @abc.abstractmethod
    def _generate(self, prompts: list[list[int]], params: SamplingSpec) -> AsyncIterator[FinishedSample]: ...

    @abc.abstractmethod
    async def pause(self, abort: bool) -> int:
        """Stops starting requests (new ones wait for resume); in-flight ones finish, or are aborted
        when `abort` (they return with Finish.ABORT). Returns how many requests were aborted."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    async def sleep(self, level: int) -> None:
        raise Unimplemented(f"the {self.name} engine cannot sleep")

    async def wake_up(self, tags: Sequence[str]) -> None:
        raise Unimplemented(f"the {self.name} engine cannot sleep, so there is nothing to wake up")

    @abc.abstractmethod
    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Swaps in named (Hugging Face names) tensors between requests, all or none; returns the new
        weight version (`version`, or the current one + 1). The weight-sync transports feed this."""

    async def swap_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> WeightSwap:
        """load_weights, also reporting how long generation was held (here: the whole load)."""
        started = time.monotonic()
        version = await self.load_weights(weights, version)
        return WeightSwap(version, time.monotonic() - started)

    # Weight sync (rlfabric.core.weight_sync). By default the bytes land in this process and are then
    # swapped in; an engine whose weights live elsewhere (vLLM's workers) receives them there instead.

    def weight_limits(self) -> WeightLimits | None:
        """The weights this engine serves (Hugging Face names), which every weight manifest must fit
        before anything is allocated for it: by default the model checkpoint's tensors, read from its
        safetensors headers once (None for a model that is not a local directory)."""
        if self._checkpoint_limits is None:
            self._checkpoint_limits = (WeightLimits.from_checkpoint(self.model),)
        return self._checkpoint_limits[0]

    async def join_weight_sync(self, group: SyncGroup, rank: int) -> None:
        """Joins (or rejoins) the actor's weight-sync group as `rank`; blocks until every rank joined."""
        await self.weight_sync.join(group, rank)

    async def receive_weights(self, manifest: Manifest) -> WeightSwap:
        """Receives the manifest's buckets while generation goes on, then swaps them in at once."""
        return await self.weight_sync.receive(manifest, lambda weights: self.swap_weights(weights, manifest.version))

    async def leave_weight_sync(self) -> None:
        await self.weight_sync.leave()

    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of chat messages through the tokenizer's chat template, with the generation prompt."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument(f"model {self.model} has no chat template: send prompts as token ids")
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True) if self.tokenizer else ""


def trust_remote_code(config) -> bool:
    """model.trust_remote_code (read defensively: the field belongs to the model section's owner)."""
    return bool(getattr(config.model, "trust_remote_code", False))


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
