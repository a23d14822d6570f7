"""The embedded transformers engine: the default for small CPU runs and tests.

It runs its own decode loop over the transformers model (forward with a DynamicCache) rather than
`model.generate`, because generate draws from one global RNG (a sample would depend on what it is
batched with) and cannot finish, stream or abort rows one by one.

Scheduling: a started request (RolloutEngine holds requests while paused or asleep) becomes rows
(prompt, sample); one scheduler task takes up to max_num_seqs queued rows, from any number of
concurrent requests, and runs them as one batch on a worker thread, so the event loop (health
checks, GetStatus) stays responsive. Each unique prompt is prefilled once and its KV cache repeated
for its n samples, and the prompts' common prefix once for all of them (rollout.enable_prefix_caching; see
hf_decode); finished rows leave the batch, and rows queued meanwhile join it (continuous
batching, hf_decode.DecodeBatch.join), up to max_num_seqs. Weight loads and sleep take the same lock
as a batch, so they happen between batches (what they do to the model: hf_weights); no row joins a batch
that a weight swap waits for. Pause(abort=True) drops the queued rows and the running batch ends its
aborted rows at its next step, each with Finish.ABORT.

Decoding keeps the host out of the per-token path: each token's random number comes from (row seed,
position) on the device (sampling.counter_uniforms), and the host reads the sampled tokens once every
`steps_per_sync` steps (8 on a GPU, where each read stalls the queue of kernels; 1 on the CPU, where it
costs nothing and decoding past a row's end would), to finish rows (EOS, stop ids and strings, length),
stream them, let rows leave and join. Tokens a row sampled after its end are discarded: a row's tokens
are the same whatever the number of steps per read and whatever else is in the batch.

Partial rollouts (rollout.partial_rollouts): a weight swap asks the running batch to stop at its next
decode step; its unfinished rows go back to the front of the queue with what they generated (tokens,
log-probs; their random numbers go on from their position), the weights change, and the next batch
prefills prompt + generated prefix under the new weights and decodes on. Each row records the version of each span of its tokens
(FinishedSample.version_spans). Without it, a swap waits for the running batch to finish.

MoE routing replay (actor.router_replay): hooks on the model's routers record the experts each MoE layer chose
for every token the batch runs (hf_decode.DecodeBatch.routes), and each finished sample carries its prompt's
and response's (FinishedSample.routed_experts; rlfabric.core.router_replay).

LoRA (weight_sync.lora resolved to adapter): the model is wrapped once at start with the actor's
adapter settings (peft, lora_B zero: it serves the base model until the first sync), and each sync
copies a new adapter version into it (swap_adapter). Full weights still load into its base layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from rlfabric.core.config import RunConfig
from rlfabric.core.dtypes import rollout_dtype, torch_dtype
from rlfabric.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from rlfabric.core.host import load_tokenizer, trust_remote_code
from rlfabric.core.moe import expert_layout
from rlfabric.core.router_replay import RouteRecorder
from rlfabric.rollout.engine import Generation, RolloutEngine
from rlfabric.rollout.hf_decode import DecodeBatch
from rlfabric.rollout.hf_weights import copy_weights, discard_weights, restore_weights
from rlfabric.rollout.routes import route_dtype, unrecorded
from rlfabric.rollout.types import (
    EngineLimits,
    Finish,
    FinishedSample,
    compact_versions,
    row_seed,
    truncate_at_stop,
)
from rlfabric.weight_sync.devices import DeviceReport, report_of
from rlfabric.weight_sync.manifest import PEFT_PREFIX, WeightLimits
from rlfabric.weight_sync.receiver import WeightSwap

log = logging.getLogger("rlfabric.rollout.hf")
WAKE_TAGS = ("weights", "kv_cache")
GPU_STEPS_PER_SYNC = 8  # decode steps between two host reads of the sampled tokens on a GPU


@dataclass(eq=False)
class _Row:
    """One sample being generated."""

    generation: Generation
    prompt_index: int
    sample_index: int
    seed: int  # row_seed: with the token's position, it fixes the token's random number
    limit: int  # most tokens it may have: max_tokens, or what the context length leaves after the prompt
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)  # (weight version, first token index)

    @property
    def prompt(self) -> list[int]:
        return self.generation.prompts[self.prompt_index]

    def budget(self) -> int:
        """How many more tokens it may generate."""
        return self.limit - len(self.token_ids)

    def prefill_key(self) -> tuple[int, int] | int:
        """Rows of one prompt with nothing generated yet share its prefill; a resumed row has its own."""
        return id(self) if self.token_ids else (id(self.generation), self.prompt_index)


class HFEngine(RolloutEngine):
    name = "hf"

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.net = None
        self._pending: deque[_Row] = deque()
        self._pending_lock = threading.Lock()  # the running batch takes rows from the queue on its thread
        self._running: list[_Row] = []
        self._lock = asyncio.Lock()  # held by a running batch, a weight load or sleep
        self._wakeup = asyncio.Event()  # rows were queued
        self._swap_waiting = False  # a weight swap waits for the lock: no row joins the running batch
        self._preempt = False  # a weight swap waits: the running batch hands its rows back (partial rollouts)
        self._scheduler: asyncio.Task | None = None
        self._discarded_shapes: dict[torch.nn.Parameter, torch.Size] = {}  # asleep at level 2: their real shapes
        self.steps_per_sync = GPU_STEPS_PER_SYNC if self.device.type == "cuda" else 1
        self._recorder: RouteRecorder | None = None  # actor.router_replay: the routers' hooks

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.model:
            raise ValueError("rollout: model.path is empty; point it at a local Hugging Face model directory")
        self.net, self.tokenizer = await asyncio.to_thread(self._load)
        cfg = self.net.config
        eos = self.net.generation_config.eos_token_id
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        max_len = self.config.rollout.max_model_len or cfg.max_position_embeddings
        self.limits = EngineLimits(cfg.vocab_size, max_len, eos_ids)
        if self.config.actor.router_replay:
            self._recorder = RouteRecorder(self.net).attach()  # hooked for the engine's life
            self._route_dtype = route_dtype(expert_layout(cfg).num_experts)
        self._scheduler = asyncio.create_task(self._schedule(), name="hf-engine-scheduler")

    def _load(self):
        from transformers import AutoModelForCausalLM

        dtype = torch_dtype(rollout_dtype(self.config), self.device)
        net = AutoModelForCausalLM.from_pretrained(
            self.model, dtype=dtype, trust_remote_code=trust_remote_code(self.config)
        )
        if self.adapter is not None:
            from rlfabric.core.lora import apply_lora

            net = apply_lora(net, self.config.actor.lora)
        net.to(self.device).eval().requires_grad_(False)
        return net, load_tokenizer(self.model, trust_remote_code(self.config))

    async def stop(self) -> None:
        """Aborts everything in flight, lets the running batch notice it, then releases the model."""
        with contextlib.suppress(DeadlineExceeded):
            await self.pause(abort=True)
        if self._scheduler is not None:
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scheduler
        await self.leave_weight_sync()
        if self._recorder is not None:
            self._recorder.detach()
        self.net = None

    # -- generation ----------------------------------------------------------------------------

    def _start_request(self, generation: Generation) -> None:
        params, max_len = generation.params, self.limits.max_model_len
        rows = [_Row(generation, p, s, row_seed(params.seed, p, s), min(params.max_tokens, max_len - len(prompt)))
                for p, s in generation.rows() for prompt in [generation.prompts[p]]]
        with self._pending_lock:
            self._pending.extend(rows)
        self._wakeup.set()

    def _end_request(self, generation: Generation) -> None:
        self._drop_pending(lambda row: row.generation is generation, deliver=False)

    async def _schedule(self) -> None:
        while True:
            self._wakeup.clear()
            batch = self._take_batch()
            if not batch:
                await self._wakeup.wait()
                continue
            async with self._lock:
                self._running = batch
                try:
                    unfinished = await asyncio.to_thread(self._run_batch, batch, self.weight_version)
                    with self._pending_lock:
                        self._pending.extendleft(reversed([r for r in unfinished if not r.generation.aborted]))
                except Exception as error:  # the engine failed: the batch's requests get UNAVAILABLE
                    log.exception("hf engine batch failed")
                    for generation in {row.generation for row in self._running}:  # rows that joined too
                        generation.put(self.failure(error))
                finally:
                    self._running = []
                    self.kv_cache_usage = 0.0

    def _take_batch(self, room: int | None = None) -> list[_Row]:
        """Up to `room` (max_num_seqs) queued rows, oldest first."""
        with self._pending_lock:
            size = min(len(self._pending), self.config.rollout.max_num_seqs if room is None else room)
            return [self._pending.popleft() for _ in range(size)]

    def _drop_pending(self, which, deliver: bool = True) -> int:
        """Removes queued rows matching `which`; delivers them as empty ABORT samples when asked."""
        kept, dropped = deque(), []
        with self._pending_lock:
            for row in self._pending:
                (dropped if which(row) else kept).append(row)
            self._pending = kept
        if deliver:
            for row in dropped:
                row.generation.put(self._finish(row, Finish.ABORT, self.weight_version))
        return len(dropped)

    def _finish(self, row: _Row, reason: Finish, version: int, routes: torch.Tensor | None = None) -> FinishedSample:
        """routes: (prompt + response tokens, layers, top_k) int16, -1 where not recorded (router replay)."""
        params = row.generation.params
        text = self.decode(row.token_ids)
        if params.stop:
            text, _ = truncate_at_stop(text, params.stop)
        logprobs = row.logprobs if params.logprobs else []
        first_version, spans = compact_versions(row.versions or [(version, 0)])
        routed = None
        if routes is not None:
            routes = routes.to(torch.int32)  # int16 cannot hold uint16's UNRECORDED
            routed = routes.masked_fill(routes < 0, unrecorded(self._route_dtype)).cpu().numpy().astype(
                self._route_dtype)
        return FinishedSample(row.prompt_index, row.sample_index, row.token_ids, logprobs, reason, first_version,
                              text, version_spans=spans, routed_experts=routed)

    @torch.inference_mode()
    def _run_batch(self, rows: list[_Row], version: int) -> list[_Row]:
        """Prefill then decode until every row is finished, or until a weight swap asks for the rows
        still going (partial rollouts), which it returns (worker thread). At each read of the tokens,
        queued rows join while there is room."""
        batch = self._prefill(rows, version)
        stop_ids = self._stop_ids(rows)
        while True:
            steps = min(self.steps_per_sync, min(r.budget() for r in rows))  # no row decodes past its limit
            must_stop = functools.partial(self._must_stop, {r.generation for r in rows})
            tokens, logprobs = batch.sample([len(r.token_ids) for r in rows], steps, must_stop)
            alive = self._take_tokens(batch, rows, tokens.tolist(), logprobs.tolist(), stop_ids, version)  # host sync
            if self._preempt or not alive:
                return [rows[i] for i in alive]
            last = tokens[:, -1]
            if len(alive) < len(rows):
                keep = torch.tensor(alive, device=self.device)
                batch.select(keep)
                last, rows = last[keep], [rows[i] for i in alive]
            batch.feed(last)
            rows = self._join(batch, rows, version, stop_ids)
            self.kv_cache_usage = min(1.0, batch.mask.numel() / (self.config.rollout.max_num_seqs
                                                                 * self.limits.max_model_len))

    def _must_stop(self, generations: set[Generation]) -> bool:
        """Read the tokens now: a weight swap waits (partial rollouts), or a request was aborted."""
        return self._preempt or any(g.aborted for g in generations)

    def _prefill(self, rows: list[_Row], version: int) -> DecodeBatch:
        """The rows on the device: each unique prompt (or a resumed row's prompt + generated prefix) once."""
        for r in rows:
            r.versions.append((version, len(r.token_ids)))
        unique: dict[tuple[int, int] | int, int] = {}  # Row.prefill_key() -> index of its prompt
        prompts = []
        for r in rows:
            if unique.setdefault(r.prefill_key(), len(prompts)) == len(prompts):
                prompts.append(r.prompt + r.token_ids)
        return DecodeBatch.prefill(self.net, prompts, [unique[r.prefill_key()] for r in rows],
                                   [r.generation.params for r in rows], [r.seed for r in rows],
                                   self.tokenizer.pad_token_id or 0, self._recorder,
                                   share_prefix=self.config.rollout.enable_prefix_caching)

    def _join(self, batch: DecodeBatch, rows: list[_Row], version: int,
              stop_ids: dict[Generation, set[int]]) -> list[_Row]:
        """Queued rows join the running batch, up to max_num_seqs, unless a weight swap waits (it would wait
        for them too). Returns the batch's rows."""
        room = self.config.rollout.max_num_seqs - len(rows)
        if room <= 0 or not self._pending or self._swap_waiting or not batch.can_join():
            return rows
        joiners = self._take_batch(room)
        if not joiners:
            return rows
        batch.join(self._prefill(joiners, version))
        stop_ids.update(self._stop_ids(joiners))
        self._running = rows = rows + joiners
        return rows

    def _stop_ids(self, rows: list[_Row]) -> dict[Generation, set[int]]:
        """The token ids that end each request's rows: EOS and its stop_token_ids."""
        return {r.generation: {*self.limits.eos_token_ids, *r.generation.params.stop_token_ids} for r in rows}

    def _take_tokens(self, batch: DecodeBatch, rows: list[_Row], tokens: list[list[int]], logprobs: list[list[float]],
                     stop_ids: dict[Generation, set[int]], version: int) -> list[int]:
        """Appends each row's new tokens up to its end and delivers the rows that ended (and those aborted),
        with one wake-up of the event loop; returns the indices of the rows going on."""
        alive, finished = [], []
        for i, (row, new, new_logprobs) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            if row.generation.aborted:
                reason = Finish.ABORT
            else:
                reason = self._append(row, new, new_logprobs, stop_ids[row.generation])
            if reason is None:
                alive.append(i)
            else:
                routes = None if batch.routes is None else batch.row_routes(i, len(row.prompt) + len(row.token_ids))
                finished.append((row.generation, self._finish(row, reason, version, routes)))
        if finished:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                finished[0][0].loop.call_soon_threadsafe(_put_each, finished)
        return alive

    def _append(self, row: _Row, new: list[int], new_logprobs: list[float], stop_ids: set[int]) -> Finish | None:
        """Appends the tokens up to the first that ends the row (an EOS or stop id, the end of a stop string,
        or its limit); the rest were sampled past its end and are dropped. Returns why it ended."""
        params = row.generation.params
        start, end, reason = len(row.token_ids), len(new), None
        if not stop_ids.isdisjoint(new):
            end, reason = next(j for j, token in enumerate(new) if token in stop_ids) + 1, Finish.STOP
        row.token_ids.extend(new[:end])
        row.logprobs.extend(new_logprobs[:end])
        if params.stop:  # the first token whose text completes a stop string
            window = max(map(len, params.stop)) + 8
            for length in range(start + 1, start + end + 1):
                if truncate_at_stop(self.decode(row.token_ids[max(0, length - window):length]), params.stop)[1]:
                    del row.token_ids[length:], row.logprobs[length:]
                    return Finish.STOP
        if reason is None and row.budget() <= 0:
            reason = Finish.LENGTH
        return reason

    # -- control -------------------------------------------------------------------------------

    async def _hold(self, abort: bool) -> None:
        if abort:
            self._drop_pending(lambda row: True)
        await self._drain()

    async def _until_drained(self) -> None:
        """Every sample delivered, and then no batch or weight load running."""
        await super()._until_drained()
        async with self._lock:
            pass

    async def _sleep(self, level: int) -> None:
        """Level 1 moves the weights to the CPU; level 2 discards them (their memory is freed), as vLLM's
        level 2 does: after WakeUp they hold garbage until the next weight sync fills them."""
        if level == 2 and self.adapter is not None:
            raise FailedPrecondition("sleep level 2 discards the base weights, which LoRA adapter syncs do not "
                                     "send again: use level 1")
        await self._drain()
        async with self._lock:
            if level == 1:
                await asyncio.to_thread(self.net.to, "cpu")
            else:
                self._discarded_shapes = discard_weights(self.net)

    async def _wake_up(self, tags: Sequence[str]) -> bool:
        unknown = set(tags) - set(WAKE_TAGS)
        if unknown:
            raise InvalidArgument(f"unknown wake-up tag(s) {sorted(unknown)}; tags are {list(WAKE_TAGS)}")
        if tags and "weights" not in tags:
            return False  # the weights are still asleep
        async with self._lock:
            restore_weights(self._discarded_shapes)
            self._discarded_shapes = {}
            await asyncio.to_thread(self.net.to, self.device)
        return True

    def device_report(self) -> DeviceReport:
        return self._device_report

    @functools.cached_property
    def _device_report(self) -> DeviceReport:  # asked once: a GPU's UUID does not change
        return report_of(self.device)

    def device_memory_bytes(self) -> int:
        """Bytes of the model's parameters and buffers on this engine's device (none while asleep)."""
        if self.net is None:
            return 0
        tensors = {id(t): t for t in (*self.net.parameters(), *self.net.buffers())}.values()
        return sum(t.numel() * t.element_size() for t in tensors if t.device.type == self.device.type)

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        return (await self.swap_weights(weights, version)).version

    def weight_limits(self) -> WeightLimits | None:
        """The loaded model's own parameters and buffers (tied names included)."""
        if self.net is None:
            return super().weight_limits()
        limits = WeightLimits.of(self._base_weights(), f"model {self.model}")
        return replace(limits, adapter=self.adapter)

    def _base_weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers (tied names included) by Hugging Face name: under peft's
        wrapping (LoRA) too, without the adapters."""
        named = dict(self.net.named_parameters(remove_duplicate=False))
        named.update(self.net.named_buffers(remove_duplicate=False))
        return {_base_name(name): tensor for name, tensor in named.items() if ".lora_" not in name}

    def _adapter_weights(self) -> dict[str, torch.Tensor]:
        """The adapter's parameters by their weight-sync (peft file) name."""
        return {name.replace(".default.weight", ".weight"): tensor for name, tensor in self.net.named_parameters()
                if ".lora_" in name}

    async def swap_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> WeightSwap:
        """Copies the weights in under the batch lock: between two batches, so no sample sees a mix;
        generation is held only while the copy runs."""
        return await self._swap(list(weights), version, self._base_weights)

    async def adopt_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightSwap:
        """A weight sync's received tensors become the parameters themselves when each has its parameter's
        dtype, device and shape (no copy: the switch takes microseconds whatever the model's size); else
        they are copied as swap_weights does."""
        return await self._swap(list(weights), version, self._base_weights, adopt=True)

    async def swap_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightSwap:
        """A new adapter version, copied into the peft layers as swap_weights copies full weights."""
        if self.adapter is None:
            return await super().swap_adapter(weights, version)
        named = list(weights)
        missing = sorted(set(self._adapter_weights()) - {name for name, _ in named})
        if missing:  # a version is the whole adapter: a partial one would mix two versions
            raise InvalidArgument(f"adapter version {version} lacks {len(missing)} weight(s), e.g. {missing[0]!r}")
        return await self._swap(named, version, self._adapter_weights)

    async def _swap(self, named: list[tuple[str, torch.Tensor]], version: int | None, targets,
                    adopt: bool = False) -> WeightSwap:
        """With partial rollouts the running batch stops at its next step and its rows go on after the swap;
        otherwise the swap waits for the batch to finish."""
        self._preempt = self.config.rollout.partial_rollouts
        self._swap_waiting = True
        try:
            async with self._lock:
                started = time.monotonic()
                adopted = await asyncio.to_thread(copy_weights, named, targets(), self.model, self.device, adopt)
                self.weight_version = self.weight_version + 1 if version is None else int(version)
                paused = time.monotonic() - started
        finally:
            self._preempt = self._swap_waiting = False
            self._wakeup.set()  # rows handed back wait in the queue
        log.info("weights loaded", extra={"fields": {"tensors": len(named), "version": self.weight_version,
                                                     "paused_s": round(paused, 4), "adopted": adopted}})
        return WeightSwap(self.weight_version, paused, adopted=adopted)


def _put_each(finished: list[tuple[Generation, FinishedSample]]) -> None:
    """Hands finished samples to their requests (on the event loop every request of the engine shares)."""
    for generation, sample in finished:
        generation.put(sample)


def _base_name(name: str) -> str:
    """A parameter's Hugging Face name, also under peft's wrapping:
    base_model.model.X.q_proj.base_layer.weight -> X.q_proj.weight."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
