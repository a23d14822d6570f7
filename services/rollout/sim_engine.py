"""The simulated engine (rollout.engine sim): no model, modelled time (rlfabric.sim.latency), random token ids.

It is a RolloutEngine like the others, behind the same servicer and router: admission, the pause/sleep gate,
deadlines and drains are the base class's. What it simulates is the scheduler of a continuous-batching engine,
driven by one asyncio timer per replica (no thread, no task per row), so hundreds of replicas fit in one process:

- a started request's rows queue; up to rollout.max_num_seqs of them run at once, the rest wait;
- every running row gains a token per decode step (latency.step_seconds of the batch size), so the replica
  keeps one token clock, and a row that joined at clock c with length L finishes at c + L (a heap of those);
- a row joining holds the batch for its prompt's prefill; the time between two events runs at a rate scaled
  by a jitter factor drawn per event; a straggler replica is slower by sim.rollout.straggler_slowdown;
- a finished row gets L token ids drawn from the vocabulary (an EOS last when it stopped by itself),
  log-probs, and text through the model's tokenizer;
- an injected failure (sim.rollout.failure_rate) delivers part of a request's samples, then UNAVAILABLE;
- a weight swap holds the batch for the modelled load time; with rollout.partial_rollouts the rows in flight
  go on under the new version (their version_spans say from which token), else the swap waits for them.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import json
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import InvalidArgument, Unavailable
from rlfabric.core.host import trust_remote_code
from rlfabric.core.metrics import service_counter
from rlfabric.rollout.engine import Generation, RolloutEngine
from rlfabric.rollout.types import EngineLimits, Finish, FinishedSample, compact_versions, row_seed
from rlfabric.sim.latency import LengthModel, RolloutLatency, jitter_factor, stragglers
from rlfabric.sim.weights import PAYLOAD_NAME, SyncCost, payload_limits
from rlfabric.weight_sync.manifest import WeightLimits

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

log = logging.getLogger("rlfabric.rollout.sim")
DEFAULT_VOCAB = 32000
DEFAULT_MAX_MODEL_LEN = 32768


@dataclass(eq=False)
class _Row:
    """One sample in the simulated scheduler."""

    generation: Generation
    prompt_index: int
    sample_index: int
    rng: np.random.Generator  # its lengths and tokens: fixed by the request's seed when it has one
    length: int  # tokens it will have
    stops: bool  # it ends with an EOS (else at max_tokens)
    start: float = 0.0  # the replica's token clock when it joined the batch
    spans: list[tuple[int, int]] = field(default_factory=list)  # (weight version, first token index)

    def generated(self, clock: float) -> int:
        return min(self.length, int(clock - self.start + 1e-9))


class SimEngine(RolloutEngine):
    name = "sim"

    def __init__(self, config: RunConfig, replica: int = 0):
        super().__init__(config)
        self.replica = replica
        self.straggler = replica in stragglers(config)
        self.latency = RolloutLatency.of(config, self.straggler)
        self.lengths = LengthModel(config)
        self.sync_cost = SyncCost.of(config)
        self.rng = np.random.default_rng([config.sim.seed, replica])
        self.injected_failures = 0
        self.unfinished_at_stop = 0  # rows queued or generating when stop() came (after its server's, undelivered)
        self.abandoned_rows = 0  # rows whose request ended before they finished (its stream cancelled)
        self._failures_metric = None
        self._queue: deque[_Row] = deque()
        self._running: list[tuple[float, int, _Row]] = []  # heap of (clock at which it ends, tie-break, row)
        self._order = itertools.count()
        self._clock = 0.0  # tokens every running row gained since the replica started
        self._last = 0.0  # loop time the clock was last advanced to
        self._held_until = 0.0  # loop time before which the batch makes no progress (prefill, weight load)
        self._factor = 1.0  # the jitter factor of the current stretch
        self._timer: asyncio.TimerHandle | None = None
        self._fail_after: dict[Generation, int] = {}  # a request that fails: samples it delivers first
        self._admitting = True  # false while a swap without partial rollouts waits for the batch
        self._idle = asyncio.Event()  # set whenever nothing runs

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        vocab, eos = model_vocab(self.model)
        vocab = self.config.sim.rollout.vocab_size or vocab
        # The simulated model's context is its own, not that of the model whose tokenizer lends the ids.
        self.limits = EngineLimits(vocab, self.config.rollout.max_model_len or DEFAULT_MAX_MODEL_LEN, eos)
        if self.model and self.config.sim.rollout.decode_text:
            self.tokenizer = shared_tokenizer(self.model, trust_remote_code(self.config))
        self._last = asyncio.get_running_loop().time()
        self._idle.set()

    async def stop(self) -> None:
        self.unfinished_at_stop = self.rows_in_flight
        await self.pause(abort=True)
        if self._timer is not None:
            self._timer.cancel()
        await self.leave_weight_sync()

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self._failures_metric = service_counter(
            registry, "rlfabric_sim_injected_failures_total", "Requests the simulated engine failed on purpose "
            "(sim.rollout.failure_rate).")

    @property
    def rows_in_flight(self) -> int:
        """Samples started and not finished: queued or in the batch."""
        return len(self._queue) + len(self._running)

    # -- the scheduler -------------------------------------------------------------------------

    def _start_request(self, generation: Generation) -> None:
        params, seeded = generation.params, generation.params.seed is not None
        for p, s in generation.rows():
            rng = np.random.default_rng(row_seed(params.seed, p, s)) if seeded else self.rng
            budget = min(params.max_tokens, self.limits.max_model_len - len(generation.prompts[p]))
            length, stops = self.lengths.draw(rng, budget)
            self._queue.append(_Row(generation, p, s, rng, length, stops))
        failure_rate = self.config.sim.rollout.failure_rate
        if failure_rate and self.rng.random() < failure_rate:
            self._fail_after[generation] = int(self.rng.integers(generation.num_rows))
        self._reschedule()

    def _end_request(self, generation: Generation) -> None:
        self._fail_after.pop(generation, None)
        before = self.rows_in_flight
        self._remove(lambda row: row.generation is generation)
        self.abandoned_rows += before - self.rows_in_flight

    def _remove(self, which) -> list[_Row]:
        """Takes the rows matching `which` out of the queue and the batch; returns those that were running."""
        self._advance()
        self._queue = deque(row for row in self._queue if not which(row))
        removed = [row for _, _, row in self._running if which(row)]
        if removed:
            self._running = [entry for entry in self._running if not which(entry[2])]
            heapq.heapify(self._running)
        self._reschedule()
        return removed

    def _advance(self) -> None:
        """Moves the token clock to now: the time since the last event, less what a hold took, at the rate
        of the current batch."""
        now = asyncio.get_running_loop().time()
        progress = now - max(self._last, self._held_until)
        if self._running and progress > 0:
            self._clock += progress / (self.latency.step_seconds(len(self._running)) * self._factor)
        self._last = now

    def _reschedule(self) -> None:
        """Finishes the rows due, lets queued rows join, and sets the timer for the next row to end."""
        self._advance()
        while self._running and self._running[0][0] <= self._clock + 1e-9:
            self._finish(heapq.heappop(self._running)[2])
        self._join()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.kv_cache_usage = len(self._running) / self.config.rollout.max_num_seqs
        if not self._running:
            self._idle.set()
            return
        self._idle.clear()
        self._factor = jitter_factor(self.rng, self.config.sim.rollout.jitter_cv)
        loop = asyncio.get_running_loop()
        tokens_left = self._running[0][0] - self._clock
        delay = max(0.0, self._held_until - loop.time()) + tokens_left * self.latency.step_seconds(
            len(self._running)) * self._factor
        self._timer = loop.call_later(delay, self._reschedule)

    def _join(self) -> None:
        """Queued rows join the batch up to rollout.max_num_seqs; their prompts' prefill holds it."""
        room = self.config.rollout.max_num_seqs - len(self._running)
        if room <= 0 or not self._queue or not self._admitting:
            return
        prefilled: set[tuple[int, int]] = set()
        tokens = 0
        while room and self._queue:
            row = self._queue.popleft()
            if row.generation.aborted:
                continue
            key = (id(row.generation), row.prompt_index)
            if key not in prefilled:
                prefilled.add(key)
                tokens += len(row.generation.prompts[row.prompt_index])
            row.start = self._clock
            row.spans = [(self.weight_version, 0)]
            heapq.heappush(self._running, (row.start + row.length, next(self._order), row))
            room -= 1
        self._hold_for(self.latency.prefill_seconds(tokens))

    def _hold_for(self, seconds: float) -> None:
        now = asyncio.get_running_loop().time()
        self._held_until = max(now, self._held_until) + seconds

    def _finish(self, row: _Row, reason: Finish | None = None) -> None:
        """Hands over a row's sample (or, past a request's injected failure, the failure)."""
        generation = row.generation
        if generation.aborted and reason is None:
            reason = Finish.ABORT
        fail_after = self._fail_after.get(generation)
        if fail_after is not None and generation.num_rows - generation.undelivered >= fail_after:
            del self._fail_after[generation]
            self.injected_failures += 1
            if self._failures_metric is not None:
                self._failures_metric.inc()
            generation.put(Unavailable(f"sim engine (replica {self.replica}): injected failure "
                                       f"(sim.rollout.failure_rate {self.config.sim.rollout.failure_rate})"))
            return
        if generation.undelivered > 0:
            generation.put(self._sample(row, reason))

    def _sample(self, row: _Row, reason: Finish | None) -> FinishedSample:
        count = row.generated(self._clock) if reason is Finish.ABORT else row.length
        vocab, eos = self.limits.vocab_size, self.limits.eos_token_ids
        tokens = row.rng.integers(0, vocab, count)
        if eos:
            tokens[np.isin(tokens, eos)] = (eos[0] + 1) % vocab  # no EOS before the end
        if reason is None:
            reason = Finish.STOP if row.stops else Finish.LENGTH
            if row.stops and eos:
                tokens[-1] = eos[0]
        token_ids = tokens.tolist()
        logprobs = (-row.rng.exponential(1.0, count)).tolist() if row.generation.params.logprobs else []
        version, spans = compact_versions(row.spans)
        return FinishedSample(row.prompt_index, row.sample_index, token_ids, logprobs, reason, version,
                              self.decode(token_ids) if self.tokenizer is not None else "", version_spans=spans)

    # -- the gate ------------------------------------------------------------------------------

    async def _hold(self, abort: bool) -> None:
        """With abort: the rows of aborted requests end now, each with what it generated (Finish.ABORT)."""
        if abort:
            self._advance()
            for row in self._remove(lambda row: row.generation.aborted):
                self._finish(row, Finish.ABORT)
        await self._drain()

    async def _sleep(self, level: int) -> None:
        await self._drain()  # nothing to free: there is no model

    async def _wake_up(self, tags: Sequence[str]) -> bool:
        return True

    # -- weights -------------------------------------------------------------------------------

    def weight_limits(self) -> WeightLimits | None:
        """The simulated actor's payload when the actor is simulated too, else the model checkpoint's."""
        return payload_limits() if self.config.actor.engine == "sim" else super().weight_limits()

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Holds the batch for the modelled load of the virtual weights (sim.rollout.weight_load_gb_per_s); with
        partial rollouts the rows in flight go on under the new version, else the swap waits for them."""
        names = [name for name, _ in weights]
        if self.config.actor.engine == "sim" and names != [PAYLOAD_NAME]:
            raise InvalidArgument(f"the sim engine takes the simulated actor's payload ({PAYLOAD_NAME}), not {names[:3]}")
        if not self.config.rollout.partial_rollouts:
            self._admitting = False
            try:
                await self._idle.wait()
            finally:
                self._admitting = True
        self._advance()
        self._hold_for(self.sync_cost.apply_s)
        self.weight_version = self.weight_version + 1 if version is None else version
        for _, _, row in self._running:
            row.spans.append((self.weight_version, row.generated(self._clock)))
        self._reschedule()
        await asyncio.sleep(max(0.0, self._held_until - asyncio.get_running_loop().time()))
        return self.weight_version


def model_vocab(path: str) -> tuple[int, tuple[int, ...]]:
    """(vocab size, EOS ids) from a model directory's config.json; 32000 and none without one."""
    config_file = Path(path) / "config.json" if path else None
    if config_file is None or not config_file.is_file():
        return DEFAULT_VOCAB, ()
    config = json.loads(config_file.read_text())
    eos = config.get("eos_token_id")
    return config.get("vocab_size", DEFAULT_VOCAB), tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


@functools.cache
def shared_tokenizer(path: str, trust: bool):
    """One tokenizer per process, however many replicas it serves."""
    from rlfabric.core.host import load_tokenizer

    return load_tokenizer(path, trust)
