"""The rollout engine: what the hf, vLLM and SGLang engines share, written once, and the few methods
each engine supplies.

The servicer turns protos into the domain types of rlfabric.rollout.types, awaits the engine and turns
results back into protos; engines never see a proto. Shared here, for every engine:

- admission: `generate` refuses a request past rollout.max_pending_requests requests held, or with
  more than rollout.max_rows_per_request samples (RESOURCE_EXHAUSTED), renders chat prompts and
  validates the request against the engine's limits (one place for the INVALID_ARGUMENT rules);
- the gate: while paused (Pause) or asleep (Sleep) a new request is held, not started, until Resume /
  WakeUp; Pause(abort=True) ends every request held, started or not, with Finish.ABORT samples;
- the deadline loop: a request's samples are yielded as they finish, all within
  rollout.request_timeout_s of its arrival (time held at the gate included);
- the drain: Pause and Sleep wait (rollout.drain_timeout_s) until every started request has
  delivered all its samples.

An engine supplies start/stop, the samples of a started request (by default `_generate_row`, one
task per (prompt, sample); an engine with its own scheduler overrides `_start_request` and
`_end_request`), what Pause does to work in flight (`_hold`), and where it can, `_release`,
`_sleep`, `_wake_up` and `load_weights`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    RlfabricError,
    Unavailable,
    Unimplemented,
)
from rlfabric.core.host import current_rss_bytes
from rlfabric.rollout.types import (
    AgentPrompt,
    EngineLimits,
    EngineStatus,
    Finish,
    FinishedSample,
    PromptInput,
    SamplingSpec,
    check_chat_roles,
    validate_request,
)
from rlfabric.weight_sync.devices import DeviceReport
from rlfabric.weight_sync.manifest import AdapterSpec, Manifest, SyncGroup, WeightLimits
from rlfabric.weight_sync.receiver import Membership, WeightSwap

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry


@dataclass(eq=False)
class Generation:
    """One generate() call as the engine holds it: what to generate and where its samples go.

    The engine hands over each FinishedSample, or one exception that fails the whole request, with
    put() (on the event loop) or put_threadsafe() (from a worker thread).
    """

    prompts: list[list[int]]
    params: SamplingSpec
    loop: asyncio.AbstractEventLoop
    progress: asyncio.Event  # the engine's: set whenever a generation moves on
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    admitted: asyncio.Event = field(default_factory=asyncio.Event)  # set once the gate lets it through
    started: bool = False  # handed to the engine (_start_request)
    aborted: bool = False  # its rows should stop: Pause(abort=True), or the caller is gone
    results: asyncio.Queue = field(default_factory=asyncio.Queue)  # FinishedSample | Exception
    tasks: list[asyncio.Task] = field(default_factory=list)  # one per row, with the default _start_request
    undelivered: int = 0  # rows not handed over yet

    def __post_init__(self):
        self.undelivered = self.num_rows

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.params.n

    def rows(self) -> list[tuple[int, int]]:
        """(prompt index, sample index) of every sample the request asks for."""
        return [(p, s) for p in range(len(self.prompts)) for s in range(self.params.n)]

    def put(self, item: FinishedSample | Exception) -> None:
        self.results.put_nowait(item)
        self.undelivered = 0 if isinstance(item, Exception) else self.undelivered - 1
        self.progress.set()

    def put_threadsafe(self, item: FinishedSample | Exception) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(self.put, item)


class RolloutEngine(abc.ABC):
    """An inference engine behind the rollout service.

    Lifecycle: start() loads the model and sets `limits` (the server reports ready after it), stop()
    releases it. generate() yields each finished sample once, as soon as it finishes; cancelling the
    iteration aborts the request's unfinished samples.
    """

    name: str = ""

    def __init__(self, config: RunConfig):
        self.config = config
        self.model = config.model.path
        self.limits: EngineLimits | None = None
        self.tokenizer = None  # a Hugging Face tokenizer, for chat templates and text
        self.weight_version = 0  # of the weights being served
        self.kv_cache_usage = 0.0  # in [0, 1], as the engine last saw it
        # the actor's weight-sync group, when joined; the bytes land on the device the engine reports
        self.weight_sync = Membership(device=self.receive_device, limits=self.weight_limits)
        # The LoRA adapter weight syncs carry (weight_sync.lora), applied on this engine's base model.
        lora = config.actor.lora
        self.adapter = (AdapterSpec.of(lora.rank, lora.alpha, lora.target_modules)
                        if config.syncs_lora_adapters() else None)
        self._checkpoint_limits: tuple[WeightLimits | None] | None = None
        self._requests: set[Generation] = set()  # held: waiting at the gate or started
        self._paused = False
        self._sleeping = False
        self._progress = asyncio.Event()  # a generation delivered a sample or ended

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    def status(self) -> EngineStatus:
        """Cheap and synchronous (metrics gauges read it at scrape time)."""
        return EngineStatus(engine=self.name, model=self.model, weight_version=self.weight_version,
                            queue_depth=len(self._requests), kv_cache_usage=self.kv_cache_usage,
                            paused=self._paused, sleeping=self._sleeping, rss_bytes=current_rss_bytes(),
                            device_memory_bytes=self.device_memory_bytes(), device=self.device_report())

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Adds the engine's own metrics to its service's registry; none by default."""
        return None

    def device_memory_bytes(self) -> int:
        """What the engine's weights and KV cache hold on its device, by its own accounting; 0 = unknown."""
        return 0

    def device_report(self) -> DeviceReport:
        """The device weight syncs land on, and its GPU's UUID (weight_sync.transport auto decides from it);
        empty = the engine cannot tell."""
        return DeviceReport()

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, prompts: Sequence[PromptInput], params: SamplingSpec) -> AsyncIterator[FinishedSample]:
        """Admits the request, holds it while paused or asleep, then yields every (prompt, sample) once,
        in the order they finish. Prompts are token ids or chat messages; a multi-turn request is served
        above the engine, each of its turns a request here (rlfabric.rollout.agent_rollout)."""
        check_chat_roles(prompts)
        generation = self._admit(prompts, params)
        deadline = time.monotonic() + self.config.rollout.request_timeout_s
        try:
            # 1. The gate: held while paused or asleep (Pause(abort=True) lets it through, aborted).
            await self._within(deadline, generation.admitted.wait(), "held while the engine was paused or asleep")
            # 2. The engine generates its rows.
            if not generation.aborted:
                generation.started = True
                self._start_request(generation)
            # 3. Each sample as it finishes, or the engine's error.
            for _ in range(generation.num_rows):
                item = await self._within(deadline, generation.results.get(), "generating")
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:  # normal end, error or the caller went away: unfinished rows are dropped
            generation.aborted = True
            self._requests.discard(generation)
            if generation.started:
                self._end_request(generation)
            self._progress.set()

    def _admit(self, prompts: Sequence[PromptInput], params: SamplingSpec) -> Generation:
        """The request as a Generation the engine holds, or the error that refuses it."""
        self.check_started()
        if params.multi_turn is not None:
            raise InvalidArgument("sampling_params.multi_turn is set: the engine generates single turns, and a "
                                  "multi-turn request goes to the rollout's agent rollouts")
        limit = self.config.rollout.max_pending_requests
        if limit and len(self._requests) >= limit:
            raise ResourceExhausted(
                f"this rollout replica holds {len(self._requests)} generation requests, its limit "
                f"(rollout.max_pending_requests={limit}): retry with backoff, send fewer, larger requests, "
                "add replicas, or raise rollout.max_pending_requests (0 = no limit)")
        token_prompts = [self._token_ids(i, prompt) for i, prompt in enumerate(prompts)]
        validate_request(token_prompts, params, self.limits)
        rows, most = len(prompts) * params.n, self.config.rollout.max_rows_per_request
        if rows > most:
            raise ResourceExhausted(f"{len(prompts)} prompts x n={params.n} = {rows} samples in one request; this "
                                    f"replica takes at most {most} (rollout.max_rows_per_request): split the request")
        generation = Generation(token_prompts, params, asyncio.get_running_loop(), self._progress)
        self._requests.add(generation)
        if not (self._paused or self._sleeping):
            generation.admitted.set()
        return generation

    def check_started(self) -> None:
        """FailedPrecondition until start() has loaded the model (and set `limits`)."""
        if self.limits is None:
            raise FailedPrecondition(f"{self.name} engine has not started")

    def _token_ids(self, index: int, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, AgentPrompt):
            raise InvalidArgument(f"prompt {index} has an environment task, but the request is not multi-turn "
                                  "(sampling_params.multi_turn unset)")
        if len(prompt) and isinstance(prompt[0], Mapping):
            return self.render_chat(prompt, index)
        return [int(token) for token in prompt]

    async def _within(self, deadline: float, step: Awaitable, doing: str):
        """Awaits one step of a request within its deadline (rollout.request_timeout_s)."""
        try:
            return await asyncio.wait_for(step, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(f"the request took longer than rollout.request_timeout_s="
                                   f"{self.config.rollout.request_timeout_s} ({doing})") from None

    def _start_request(self, generation: Generation) -> None:
        """Starts generating the request's rows: by default one task per (prompt, sample)."""
        generation.tasks = [asyncio.create_task(self._run_row(generation, p, s)) for p, s in generation.rows()]

    def _end_request(self, generation: Generation) -> None:
        """The request ended (done, failed, or its caller went away): stops its unfinished rows."""
        for task in generation.tasks:
            task.cancel()

    async def _run_row(self, generation: Generation, prompt_index: int, sample_index: int) -> None:
        try:
            generation.put(await self._generate_row(generation, prompt_index, sample_index))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            generation.put(self.failure(error))

    async def _generate_row(self, generation: Generation, prompt_index: int, sample_index: int) -> FinishedSample:
        """One sample of the request (the default _start_request awaits one of these per row)."""
        raise NotImplementedError(f"the {self.name} engine generates through its own scheduler")

    def failure(self, error: Exception) -> RlfabricError:
        """What a request gets when the engine failed to generate its samples: a domain error as it is;
        anything else is the engine itself failing, UNAVAILABLE with the cause (another replica may serve)."""
        if isinstance(error, RlfabricError):
            return error
        return Unavailable(f"{self.name} engine failed: {type(error).__name__}: {error}")

    # -- the gate: pause, resume, sleep, wake up -----------------------------------------------

    async def pause(self, abort: bool) -> int:
        """New requests wait for Resume. Requests already let through finish before this returns, or with
        `abort` end now with Finish.ABORT samples, held ones too. Returns how many requests were aborted."""
        self._paused = True
        aborted = self._abort_all() if abort else 0
        await self._hold(abort)
        return aborted

    async def resume(self) -> None:
        await self._release()
        self._paused = False
        self._open_gate()

    async def sleep(self, level: int) -> None:
        """Holds new requests, lets started ones finish, then frees the engine's memory (level 1: offload
        the weights, level 2: discard them). A sleep that fails leaves the engine awake."""
        if level not in (1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2 (got {level})")
        self._sleeping = True
        try:
            await self._sleep(level)
        except Exception:
            self._sleeping = False
            self._open_gate()
            raise

    async def wake_up(self, tags: Sequence[str]) -> None:
        """Restores what sleep freed (all of it without tags); held requests start once the engine can
        generate again."""
        if await self._wake_up(tags):
            self._sleeping = False
            self._open_gate()

    def _abort_all(self) -> int:
        """Marks every request held as aborted; one not started yet ends here, each sample empty."""
        live = [g for g in self._requests if not g.aborted and g.undelivered > 0]
        for generation in live:
            generation.aborted = True
            if not generation.started:
                for p, s in generation.rows():
                    generation.put(FinishedSample(p, s, [], [], Finish.ABORT, self.weight_version))
                generation.admitted.set()  # its generate() goes on to read them
        return len(live)

    def _open_gate(self) -> None:
        if not (self._paused or self._sleeping):
            for generation in self._requests:
                generation.admitted.set()

    async def _drain(self) -> None:
        """Waits until every request let through has delivered all its samples (rollout.drain_timeout_s)."""
        timeout = self.config.rollout.drain_timeout_s
        try:
            await asyncio.wait_for(self._until_drained(), timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"in-flight requests did not finish within rollout.drain_timeout_s={timeout}") from None

    async def _until_drained(self) -> None:
        while any(g.admitted.is_set() and g.undelivered > 0 for g in self._requests):
            self._progress.clear()
            await self._progress.wait()

    async def _hold(self, abort: bool) -> None:
        """The engine's part of Pause, new requests being held already: with `abort`, end the rows in
        flight early (each delivered as a Finish.ABORT sample); then drain."""
        await self._drain()

    async def _release(self) -> None:
        """The engine's part of Resume, before held requests start: nothing by default."""
        return None

    async def _sleep(self, level: int) -> None:
        """The engine's part of Sleep: drain, then free memory."""
        raise Unimplemented(f"the {self.name} engine cannot sleep")

    async def _wake_up(self, tags: Sequence[str]) -> bool:
        """The engine's part of WakeUp; returns whether it can generate again."""
        raise Unimplemented(f"the {self.name} engine cannot sleep, so there is nothing to wake up")

    # -- weights -------------------------------------------------------------------------------

    @abc.abstractmethod
    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Swaps in named (Hugging Face names) tensors between requests, all or none; returns the new
        weight version (`version`, or the current one + 1). The weight-sync transports feed this."""

    async def swap_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> WeightSwap:
        """load_weights, also reporting how long generation was held (here: the whole load)."""
        started = time.monotonic()
        version = await self.load_weights(weights, version)
        return WeightSwap(version, time.monotonic() - started)

    # Weight sync (rlfabric.weight_sync). By default the bytes land in this process and are then
    # swapped in; an engine whose weights live elsewhere (vLLM's workers) receives them there instead.

    def weight_limits(self) -> WeightLimits | None:
        """The weights this engine serves (Hugging Face names), which every weight manifest must fit
        before anything is allocated for it: by default the model checkpoint's tensors, read from its
        safetensors headers once (None for a model that is not a local directory)."""
        if self._checkpoint_limits is None:
            limits = WeightLimits.from_checkpoint(self.model)
            self._checkpoint_limits = (limits and replace(limits, adapter=self.adapter),)
        return self._checkpoint_limits[0]

    def receive_device(self) -> torch.device:
        """Where weight syncs land in this process (nccl and cuda_ipc receive on the engine's GPU): the device
        an engine that computes in this process holds (its `device`), else the host."""
        import torch

        device = getattr(self, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    async def join_weight_sync(self, group: SyncGroup, rank: int) -> None:
        """Joins (or rejoins) the actor's weight-sync group as `rank`; blocks until every rank joined."""
        await self.weight_sync.join(group, rank)

    async def receive_weights(self, manifest: Manifest) -> WeightSwap:
        """Receives the manifest's buckets while generation goes on, then swaps them in at once; the swap
        carries this replica's phases (wire, checksum, apply)."""
        adopt = not manifest.keep_base  # a kept base stays the receiver's (weight_sync.delta)
        swap, phases = await self.weight_sync.receive(manifest, lambda weights: self.apply_weights(weights, manifest,
                                                                                                   adopt=adopt))
        return replace(swap, phases=phases)

    async def apply_weights(self, weights: Iterable[tuple[str, torch.Tensor]], manifest: Manifest,
                            adopt: bool = False) -> WeightSwap:
        """Swaps in what a weight sync brought: full weights, or with manifest.adapter a LoRA adapter. `adopt`:
        nobody else holds the tensors (a receiver's buffers, which it gives up when the swap says adopted)."""
        if manifest.adapter is not None:
            return await self.swap_adapter(weights, manifest.version)
        if adopt:
            return await self.adopt_weights(weights, manifest.version)
        return await self.swap_weights(weights, manifest.version)

    async def adopt_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightSwap:
        """swap_weights for tensors nobody else holds: an engine may serve them as they are instead of copying
        them (the swap then says adopted). This one copies."""
        return await self.swap_weights(weights, version)

    async def swap_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightSwap:
        """Serves a new LoRA adapter version (peft names, checked against self.adapter) from the next
        request on; the base weights stay."""
        raise FailedPrecondition(f"the {self.name} engine cannot load LoRA adapters (weight_sync.lora: merged)")

    async def leave_weight_sync(self) -> None:
        await self.weight_sync.leave()

    # -- text ----------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[Mapping[str, str]], index: int = 0) -> list[int]:
        """Token ids of chat messages through the tokenizer's chat template, with the generation prompt;
        a template that rejects the messages (jinja's raise_exception) is a bad request."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument(f"model {self.model} has no chat template: send prompts as token ids")
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=False)
        except TemplateError as error:
            raise InvalidArgument(f"prompt {index}: the chat template of model {self.model} rejected the "
                                  f"messages: {error}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True) if self.tokenizer else ""
