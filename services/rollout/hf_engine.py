"""The embedded transformers engine: the default for small CPU runs and tests.

It runs its own decode loop over the transformers model (forward with a DynamicCache) rather than
`model.generate`, because generate draws from one global RNG (a sample would depend on what it is
batched with) and cannot finish, stream or abort rows one by one.

Scheduling: requests become rows (prompt, sample); one scheduler task takes up to max_num_seqs
queued rows, from any number of concurrent requests, and runs them as one batch on a worker
thread, so the event loop (health checks, GetStatus) stays responsive. Each unique prompt is
prefilled once and its KV cache repeated for its n samples; finished rows leave the batch.
Weight loads and sleep take the same lock as a batch, so they happen between batches.
Pause (like vLLM's "wait" mode): requests accepted before it run to the end, later ones are held
(not admitted) until Resume; Pause(abort=True) ends everything in flight with Finish.ABORT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from rlfabric.core.config import RunConfig
from rlfabric.core.dtypes import rollout_dtype, torch_dtype
from rlfabric.core.errors import DeadlineExceeded, InvalidArgument, Unavailable, Unimplemented
from rlfabric.core.weight_sync import WeightLimits, WeightSwap
from rlfabric.rollout.engine import RolloutEngine, load_tokenizer, trust_remote_code
from rlfabric.rollout.sampling import sample_tokens
from rlfabric.rollout.types import (
    EngineLimits,
    EngineStatus,
    Finish,
    FinishedSample,
    SamplingSpec,
    row_seed,
    truncate_at_stop,
)

log = logging.getLogger("rlfabric.rollout.hf")
WAKE_TAGS = ("weights", "kv_cache")


@dataclass(eq=False)
class _Request:
    """One generate() call: its sampling parameters and where finished samples go."""

    prompts: list[list[int]]
    params: SamplingSpec
    loop: asyncio.AbstractEventLoop
    progress: asyncio.Event  # the engine's: set whenever a request moves on
    admitted: bool  # False while it arrived during Pause/Sleep: its rows wait for Resume/WakeUp
    undelivered: int = 0  # rows not handed over yet
    results: asyncio.Queue = field(default_factory=asyncio.Queue)  # FinishedSample | Exception
    aborted: bool = False

    def deliver(self, item) -> None:
        """Thread-safe hand-over to the request's event loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(self._arrive, item)

    def _arrive(self, item) -> None:
        self.results.put_nowait(item)
        self.undelivered = 0 if isinstance(item, Exception) else self.undelivered - 1
        self.progress.set()


@dataclass(eq=False)
class _Row:
    """One sample being generated."""

    request: _Request
    prompt_index: int
    sample_index: int
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def prompt(self) -> list[int]:
        return self.request.prompts[self.prompt_index]


class HFEngine(RolloutEngine):
    name = "hf"

    def __init__(self, config: RunConfig):
        super().__init__(config.model.path)
        self.config = config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.net = None
        self._version = 0
        self._pending: deque[_Row] = deque()
        self._requests: set[_Request] = set()
        self._running: list[_Row] = []
        self._lock = asyncio.Lock()  # held by a running batch, a weight load or sleep
        self._wakeup = asyncio.Event()  # rows were queued or admitted
        self._progress = asyncio.Event()  # a row was delivered
        self._paused = False
        self._sleeping = False
        self._kv_usage = 0.0
        self._scheduler: asyncio.Task | None = None

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
        self._scheduler = asyncio.create_task(self._schedule(), name="hf-engine-scheduler")

    def _load(self):
        from transformers import AutoModelForCausalLM

        dtype = torch_dtype(rollout_dtype(self.config), self.device)
        net = AutoModelForCausalLM.from_pretrained(
            self.model, dtype=dtype, trust_remote_code=trust_remote_code(self.config)
        )
        net.to(self.device).eval().requires_grad_(False)
        return net, load_tokenizer(self.model, trust_remote_code(self.config))

    async def stop(self) -> None:
        """Aborts everything in flight, lets the running batch notice it, then releases the model."""
        self._paused = True
        for request in list(self._requests):
            request.aborted = True
        self._drop_pending(lambda row: True)
        with contextlib.suppress(DeadlineExceeded):
            await self._drain()
        if self._scheduler is not None:
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scheduler
        await self.leave_weight_sync()
        self.net = None

    def status(self) -> EngineStatus:
        return EngineStatus(
            engine=self.name, model=self.model, weight_version=self._version, queue_depth=len(self._requests),
            kv_cache_usage=self._kv_usage, paused=self._paused, sleeping=self._sleeping,
        )

    # -- generation ----------------------------------------------------------------------------

    async def _generate(self, prompts: list[list[int]], params: SamplingSpec) -> AsyncIterator[FinishedSample]:
        request = _Request(prompts, params, asyncio.get_running_loop(), self._progress,
                           admitted=not (self._paused or self._sleeping), undelivered=len(prompts) * params.n)
        rows = [_Row(request, p, s, torch.Generator().manual_seed(row_seed(params.seed, p, s)))
                for p in range(len(prompts)) for s in range(params.n)]
        self._requests.add(request)
        self._pending.extend(rows)
        self._wakeup.set()
        deadline = time.monotonic() + self.config.rollout.request_timeout_s
        try:
            for _ in rows:
                try:
                    item = await asyncio.wait_for(request.results.get(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise DeadlineExceeded(f"generation took longer than rollout.request_timeout_s="
                                           f"{self.config.rollout.request_timeout_s}") from None
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:  # normal end, error or the caller went away: unfinished rows are dropped
            request.aborted = True
            self._drop_pending(lambda row: row.request is request, deliver=False)
            self._requests.discard(request)
            self._progress.set()

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
                    await asyncio.to_thread(self._run_batch, batch, self._version)
                except Exception as error:  # the engine failed: the batch's requests get UNAVAILABLE
                    log.exception("hf engine batch failed")
                    for request in {row.request for row in batch}:
                        request.deliver(Unavailable(f"hf engine failed: {type(error).__name__}: {error}"))
                finally:
                    self._running = []
                    self._kv_usage = 0.0

    def _take_batch(self) -> list[_Row]:
        """Up to max_num_seqs queued rows of admitted requests, oldest first."""
        batch, kept = [], deque()
        for row in self._pending:
            fits = row.request.admitted and len(batch) < self.config.rollout.max_num_seqs
            (batch if fits else kept).append(row)
        self._pending = kept
        return batch

    def _drop_pending(self, which, deliver: bool = True) -> int:
        """Removes queued rows matching `which`; delivers them as empty ABORT samples when asked."""
        kept, dropped = deque(), []
        for row in self._pending:
            (dropped if which(row) else kept).append(row)
        self._pending = kept
        if deliver:
            for row in dropped:
                row.request.deliver(self._finish(row, Finish.ABORT, self._version))
        return len(dropped)

    def _finish(self, row: _Row, reason: Finish, version: int) -> FinishedSample:
        text = self.decode(row.token_ids)
        if row.request.params.stop:
            text, _ = truncate_at_stop(text, row.request.params.stop)
        logprobs = row.logprobs if row.request.params.logprobs else []
        return FinishedSample(row.prompt_index, row.sample_index, row.token_ids, logprobs, reason, version, text)

    @torch.inference_mode()
    def _run_batch(self, rows: list[_Row], version: int) -> None:
        """Prefill then decode until every row is finished (worker thread)."""
        device = self.device
        # 1. Prefill each unique prompt once, left-padded.
        unique: dict[tuple[int, int], int] = {}  # (request, prompt index) -> row of the prefill
        prompts = []
        for r in rows:
            if unique.setdefault((id(r.request), r.prompt_index), len(prompts)) == len(prompts):
                prompts.append(r.prompt)
        width = max(map(len, prompts))
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (U, P)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (U, P)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (U, P)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.net.config)
        out = self.net(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1)
        # 2. Repeat each prompt's cache for its samples.
        expand = torch.tensor([unique[(id(r.request), r.prompt_index)] for r in rows], device=device)  # (B,)
        logits = out.logits[:, -1, :][expand]  # (B, V)
        cache.batch_select_indices(expand)
        mask, next_pos = mask[expand], positions[expand, -1] + 1  # (B, P), (B,)
        params = [r.request.params for r in rows]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        capacity = self.config.rollout.max_num_seqs * self.limits.max_model_len
        # 3. Decode: sample, finish rows, feed the survivors.
        while rows:
            uniforms = torch.stack([torch.rand((), generator=r.generator, dtype=torch.float64) for r in rows])
            tokens, logprobs = sample_tokens(logits, temperature, top_k, top_p, uniforms.to(device))
            alive = []
            for i, (row, token, logprob) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)):
                if row.request.aborted:
                    row.request.deliver(self._finish(row, Finish.ABORT, version))
                    continue
                row.token_ids.append(token)
                row.logprobs.append(logprob)
                reason = self._finish_reason(row, token)
                if reason is None:
                    alive.append(i)
                else:
                    row.request.deliver(self._finish(row, reason, version))
            if not alive:
                break
            if len(alive) < len(rows):
                keep = torch.tensor(alive, device=device)
                cache.batch_select_indices(keep)
                mask, next_pos, tokens = mask[keep], next_pos[keep], tokens[keep]
                temperature, top_k, top_p = temperature[keep], top_k[keep], top_p[keep]
                rows = [rows[i] for i in alive]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)  # (B, P + t)
            self._kv_usage = min(1.0, len(rows) * mask.shape[1] / capacity)
            out = self.net(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                           past_key_values=cache, use_cache=True)
            logits, next_pos = out.logits[:, -1, :], next_pos + 1

    def _finish_reason(self, row: _Row, token: int) -> Finish | None:
        params = row.request.params
        if token in self.limits.eos_token_ids or token in params.stop_token_ids:
            return Finish.STOP
        if params.stop:
            tail = self.decode(row.token_ids[-(max(map(len, params.stop)) + 8):])
            if truncate_at_stop(tail, params.stop)[1]:
                return Finish.STOP
        if len(row.token_ids) >= params.max_tokens or len(row.prompt) + len(row.token_ids) >= self.limits.max_model_len:
            return Finish.LENGTH
        return None

    # -- control -------------------------------------------------------------------------------

    async def pause(self, abort: bool) -> int:
        """Requests from now on wait for Resume; in-flight ones finish (or are aborted) before this returns."""
        self._paused = True
        aborted = 0
        if abort:
            for request in self._requests:
                aborted += not request.aborted
                request.aborted = True
            self._drop_pending(lambda row: True)
        await self._drain()
        return aborted

    async def _drain(self) -> None:
        """Waits until admitted requests have all their rows delivered and no batch or weight load runs."""
        timeout = self.config.rollout.drain_timeout_s
        deadline = time.monotonic() + timeout
        try:
            while any(r.admitted and r.undelivered > 0 and not r.aborted for r in self._requests):
                self._progress.clear()
                await asyncio.wait_for(self._progress.wait(), max(0.0, deadline - time.monotonic()))
            await asyncio.wait_for(self._lock.acquire(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(f"in-flight requests did not finish within rollout.drain_timeout_s={timeout}") from None
        self._lock.release()

    def _admit_all(self) -> None:
        if not (self._paused or self._sleeping):
            for request in self._requests:
                request.admitted = True
            self._wakeup.set()

    async def resume(self) -> None:
        self._paused = False
        self._admit_all()

    async def sleep(self, level: int) -> None:
        if level != 1:
            raise Unimplemented(f"the hf engine supports sleep level 1 (offload weights to CPU) only, not {level}")
        self._sleeping = True
        await self._drain()
        async with self._lock:
            await asyncio.to_thread(self.net.to, "cpu")

    async def wake_up(self, tags: Sequence[str]) -> None:
        unknown = set(tags) - set(WAKE_TAGS)
        if unknown:
            raise InvalidArgument(f"unknown wake-up tag(s) {sorted(unknown)}; tags are {list(WAKE_TAGS)}")
        async with self._lock:
            if not tags or "weights" in tags:
                await asyncio.to_thread(self.net.to, self.device)
                self._sleeping = False
                self._admit_all()

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        return (await self.swap_weights(weights, version)).version

    def weight_limits(self) -> WeightLimits | None:
        """The loaded model's own parameters and buffers (tied names included)."""
        if self.net is None:
            return super().weight_limits()
        named = dict(self.net.named_parameters(remove_duplicate=False))
        named.update(self.net.named_buffers(remove_duplicate=False))
        return WeightLimits.of(named, f"model {self.model}")

    async def swap_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> WeightSwap:
        """Copies the weights in under the batch lock: between two batches, so no sample sees a mix;
        generation is held only while the copy runs."""
        named = list(weights)
        async with self._lock:
            started = time.monotonic()
            await asyncio.to_thread(self._copy_weights, named)
            self._version = self._version + 1 if version is None else int(version)
            paused = time.monotonic() - started
        log.info("weights loaded", extra={"fields": {"tensors": len(named), "version": self._version,
                                                     "paused_s": round(paused, 4)}})
        return WeightSwap(self._version, paused)

    def _copy_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Checks every tensor first, then copies all of them: a bad update changes nothing."""
        targets = dict(self.net.named_parameters(remove_duplicate=False))
        targets.update(self.net.named_buffers(remove_duplicate=False))
        for name, tensor in named:
            if name not in targets:
                raise InvalidArgument(f"unknown weight {name!r} for model {self.model}")
            if tuple(tensor.shape) != tuple(targets[name].shape):
                raise InvalidArgument(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                      f"the model's is {tuple(targets[name].shape)}")
        with torch.no_grad():
            for name, tensor in named:
                targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
