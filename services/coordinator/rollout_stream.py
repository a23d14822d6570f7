"""The rollout side of the loop: generation that streams on ahead of training, within a staleness bound.

    stream = RolloutStream(sampler, config, dataset, cursor, first_step=step + 1)
    taken = await stream.take(step, timer)   # data.train_batch_size scored groups for `step`
    ...                                      # the step trains on them and syncs the weights
    stream.trained(step)                     # generation may now run one step further ahead
    stream.close()                           # cancels what is still generating

The stream owns the data cursor (it draws the prompts from `cursor` on) and generates through the Sampler
(sampler.py): it generates and scores rows, gives the sampling settings of a gen batch, and holds the weight
versions (which one the rollout serves, which one holds the policy after a step).

Units: a group is one prompt's n samples; a step trains on B = data.train_batch_size groups; a gen batch is B
prompts drawn from the dataloader and generated as one stream of requests, seeded by its index (so in sync
mode, gen batch s is step s's batch, as before).

Staleness k (trainer.max_staleness in async mode; 0 in sync mode). Once step t's weights are synced,
generation may run for steps up to t + 1 + k: gen batches start while the groups taken, ready and in flight
cover fewer steps than that. A group started after step t's sync holds no token older than version(t), so it
is at most k versions behind step t + 1 + k's policy. Weight syncs do not wait for generation: with
rollout.partial_rollouts the engines switch samples in flight to the new weights, and each sample says which
version made which tokens (FinishedSample.version_spans). Staleness is taken by a sample's oldest token.

Groups go to the step that takes them oldest first. One whose oldest token would be more than k versions
behind the policy of the step taking it (groups finish out of order; dynamic sampling generates extra) is
dropped, never trained on, and counted (rollout/stale_groups); so is a gen batch still generating once no
later step can train on it within the bound. A sample from weights older than those the rollout served when
its generation started means a replica serves stale weights: FAILED_PRECONDITION.

Dynamic sampling (algorithm.filter_groups, DAPO): a scored group whose metric is the same for every sample is
dropped (it gives a group baseline no signal), and more gen batches are drawn until the step has B groups.
filter_groups.max_num_gen_batches caps the gen batches drawn for one step (0 = no cap); a step that reaches it
short of B groups fails with FAILED_PRECONDITION, as VeRL raises: training on a smaller batch would change the
step's batch size and loss scale behind the user's back.

Tracing: a gen batch started while its step waits for it (always, in sync mode, where a step's generation
starts when the step does) runs in the step's `gen` phase, so its Generate and Score calls are in the step's
trace. A gen batch started ahead of its step (async mode) is a trace of its own: a root span `generate`
(rlfabric.gen_batch, rlfabric.step: the step it was drawn for, rlfabric.weight_version: the version served
when it started) over its Generate and Score calls. A step's `train_step` span links (OpenTelemetry span
links, rlfabric.gen_batch and rlfabric.groups: how many of its groups) to the span every gen batch it takes
groups from ran under, when that is not in the step's own trace: a `generate` span, or the `gen` phase of
the earlier step that waited while it ran (groups finish out of order: a step may train on groups
generated for the next one).

A resume continues from the first gen batch not wholly trained on (or dropped), so a checkpoint taken while
generation runs ahead regenerates the prompts in flight; groups of that gen batch already trained on (groups
are taken out of order) are trained on again.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlfabric.algorithms.dapo import filter_groups
from rlfabric.coordinator.sampler import Sampler
from rlfabric.coordinator.step_metrics import StepTimer
from rlfabric.core import tracing
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition
from rlfabric.data.dataset import DataCursor, PromptRow, RLHFDataset
from rlfabric.reward.items import ItemResult
from rlfabric.rollout.types import FinishedSample

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

log = logging.getLogger("rlfabric.coordinator.rollout")

GENERATING, READY, TAKEN, FILTERED, STALE = "generating", "ready", "taken", "filtered", "stale"

@dataclass(eq=False)
class Group:
    """One prompt's n samples on their way: generated, scored, then taken by a step or dropped."""

    row: PromptRow
    gen_batch: GenBatch
    position: int  # the prompt's index in its gen batch
    samples: list[FinishedSample] = field(default_factory=list)  # in sample order (an agent episode: its segments)
    results: dict[int, ItemResult] = field(default_factory=dict)  # by sample index
    resolved_at: float = 0.0  # perf_counter() when it was scored and kept (or dropped)
    _state: str = GENERATING
    _oldest: int | None = None

    def __post_init__(self):
        self.gen_batch.states[self._state] += 1

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        # Its gen batch counts its groups by state: the stream asks how many are in flight after every
        # group it resolves, and a walk over every group each time made a step quadratic in its prompts.
        self.gen_batch.states[self._state] -= 1
        self.gen_batch.states[state] += 1
        self._state = state

    def oldest_version(self) -> int:
        """The oldest weight version of its tokens (agent episodes that recorded no call: its gen batch's start).
        Asked of scored groups only (their samples are final), and then at every wake of a waiting step: kept."""
        if self._oldest is None:
            self._oldest = min((sample.weight_version for sample in self.samples),
                               default=self.gen_batch.started_version)
        return self._oldest

    def order(self) -> tuple[int, int]:
        """Dataloader order: a step's groups are laid out in it."""
        return self.gen_batch.index, self.position


@dataclass(eq=False)
class GenBatch:
    """B prompts drawn together and generated as one stream."""

    index: int
    cursor_before: DataCursor  # the dataloader position before its prompts were drawn
    fill_step: int  # the step whose batch it was drawn for (dynamic sampling's cap counts per step)
    started_version: int  # the weight version the rollout served when it started
    started_at: float  # perf_counter()
    groups: list[Group] = field(default_factory=list)
    states: Counter = field(default_factory=Counter)  # its groups by state (Group.state keeps it)
    ahead: bool = False  # started before its step waited for it: traced on its own (own_trace)
    trace: SpanContext | None = None  # while tracing, the span it ran under: steps of other traces link to it
    task: asyncio.Task | None = None

    def active(self) -> bool:
        return self.states[GENERATING] + self.states[READY] > 0


@dataclass
class TakenGroups:
    """What one step trains on: rows and samples laid out prompt by prompt, with the scorer's results."""

    rows: list[PromptRow]  # one per prompt
    samples: list[FinishedSample]  # prompt_index = index in rows
    results: dict[tuple[int, int], ItemResult]  # (prompt_index, sample_index) -> result
    metrics: dict[str, float]


class RolloutStream:
    """Keeps generation going for up to k steps ahead of training (see the module docstring)."""

    def __init__(self, sampler: Sampler, config: RunConfig, dataset: RLHFDataset, cursor: DataCursor,
                 first_step: int):
        self.sampler = sampler
        self.versions = sampler.versions
        self.cursor = cursor.copy()  # the next prompt to draw; batches advance it
        self.batches: Iterator[list[PromptRow]] = dataset.batches(config.data.train_batch_size, config.data.seed,
                                                                  self.cursor)
        self.first_step = first_step
        self.batch_size = config.data.train_batch_size
        self.n = config.rollout.n
        self.max_staleness = config.trainer.max_staleness if config.trainer.mode == "async" else 0
        self.filter = config.algorithm.filter_groups
        self.trained_step = first_step - 1  # the last step whose weights the rollout serves
        self.steps_taken = 0
        self.gen_batches: list[GenBatch] = []  # active ones: a group still generating or ready
        self.ready: list[Group] = []
        self.gen_batches_per_step: dict[int, int] = {}
        self.next_index = first_step
        self.error: BaseException | None = None
        self.changed = asyncio.Event()  # a group was resolved, or generation failed
        self.waiting_step: int | None = None  # the step take() waits for
        self.waiting_context: contextvars.Context | None = None  # ... in its `gen` phase (its trace)
        self.counts = {"stale": 0, "kept": 0, "filtered": 0}  # since the last take

    # -- the step's side ---------------------------------------------------------------------------

    async def take(self, step: int, timer: StepTimer) -> TakenGroups:
        """B groups for `step`, each within the staleness bound of its policy (version(step - 1)); waits
        under timer "gen" for what is not ready yet. timer "gen_overlapped": the rest of their generation
        and scoring (from their gen batches' start to the last one scored), which ran hidden while earlier
        steps trained."""
        policy = self.versions.after(step - 1)
        waited_from = time.perf_counter()
        self.waiting_step = step
        with timer("gen"):
            self.waiting_context = contextvars.copy_context()  # the gen batches started for the step run in it
            while True:
                if self.error is not None:
                    raise self.error
                self._drop_stale(policy)
                self._top_up()
                if len(self.ready) >= self.batch_size:
                    break
                if not self._in_flight():
                    raise self._short_of_groups(step)
                self.changed.clear()
                await self.changed.wait()
        taken_at = time.perf_counter()
        self.waiting_step, self.waiting_context = None, None
        self.ready.sort(key=lambda g: (g.oldest_version(), g.order()))
        taken, self.ready = self.ready[: self.batch_size], self.ready[self.batch_size :]
        taken.sort(key=Group.order)
        for group in taken:
            group.state = TAKEN
        for gen_batch, groups in Counter(group.gen_batch for group in taken).items():
            timer.trace.link(gen_batch.trace, gen_batch=gen_batch.index, groups=groups)
        self.steps_taken += 1
        started = min(group.gen_batch.started_at for group in taken)
        generating = max(group.resolved_at for group in taken) - started
        timer.seconds["gen_overlapped"] = max(0.0, generating - (taken_at - waited_from))
        metrics = self._metrics(step, taken, policy)
        self.gen_batches_per_step = {s: count for s, count in self.gen_batches_per_step.items() if s > step}
        self._drop_stale(self.versions.after(step))  # what no later step may train on
        return self._layout(taken, metrics)

    def trained(self, step: int) -> None:
        """Step `step`'s weights are synced: generation may run one step further (in sync mode it starts
        when the next step does: take())."""
        self.trained_step = step
        if self.max_staleness > 0:
            self._top_up()

    def untrained_cursor(self) -> DataCursor:
        """Where a resume continues: the first gen batch not wholly trained on or dropped."""
        active = [gen_batch for gen_batch in self.gen_batches if gen_batch.active()]
        cursor = active[0].cursor_before if active else self.cursor
        return cursor.copy()

    def close(self) -> None:
        for gen_batch in self.gen_batches:
            self._cancel(gen_batch)

    # -- what runs when ------------------------------------------------------------------------------

    def _claimed(self) -> int:
        """Groups of the steps generation has covered: taken, ready or in flight."""
        return self.steps_taken * self.batch_size + len(self.ready) + self._in_flight()

    def _in_flight(self) -> int:
        return sum(gen_batch.states[GENERATING] for gen_batch in self.gen_batches)

    def _top_up(self) -> None:
        """Starts gen batches until generation covers the steps up to trained_step + 1 + k."""
        limit = (self.trained_step + 1 + self.max_staleness - self.first_step + 1) * self.batch_size
        while self.error is None and self._claimed() < limit:
            fill_step = self.first_step + self._claimed() // self.batch_size
            cap = self.filter.max_num_gen_batches if self.filter.enable else 0
            if cap and self.gen_batches_per_step.get(fill_step, 0) >= cap:
                return
            self.gen_batches_per_step[fill_step] = self.gen_batches_per_step.get(fill_step, 0) + 1
            self._start(fill_step)

    def _start(self, fill_step: int) -> None:
        cursor_before = self.cursor.copy()
        rows = next(self.batches)
        gen_batch = GenBatch(self.next_index, cursor_before, fill_step, self.versions.served, time.perf_counter(),
                             ahead=fill_step != self.waiting_step)
        gen_batch.groups = [Group(row, gen_batch, position) for position, row in enumerate(rows)]
        self.next_index += 1
        # The trace of the step that waits for it (whichever task starts it), or, running ahead, a context
        # of its own (where _generate opens its own trace).
        context = contextvars.Context() if gen_batch.ahead else self.waiting_context.copy()
        gen_batch.task = asyncio.create_task(self._generate(gen_batch), name=f"gen-batch-{gen_batch.index}",
                                             context=context)
        self.gen_batches.append(gen_batch)

    def _drop_stale(self, policy: int) -> None:
        """Drops the ready groups more than k versions behind `policy`, and cancels the gen batches still
        generating that started that far behind."""
        bound = policy - self.max_staleness
        stale = [group for group in self.ready if group.oldest_version() < bound]
        for group in stale:
            group.state = STALE
        if stale:
            self.ready = [group for group in self.ready if group.state == READY]
        self.counts["stale"] += len(stale)
        for gen_batch in self.gen_batches:
            if gen_batch.started_version < bound:
                self._cancel(gen_batch)
        self.gen_batches = [gen_batch for gen_batch in self.gen_batches if gen_batch.active()]

    def _cancel(self, gen_batch: GenBatch) -> None:
        if gen_batch.task is not None:  # its generation and the Score calls it started
            gen_batch.task.cancel()
        for group in gen_batch.groups:
            if group.state == GENERATING:
                group.state = STALE
                self.counts["stale"] += 1

    def _short_of_groups(self, step: int) -> FailedPrecondition:
        cap = self.filter.max_num_gen_batches
        return FailedPrecondition(
            f"step {step}: dynamic sampling (algorithm.filter_groups) kept {len(self.ready)} of the "
            f"{self.batch_size} groups the batch needs after algorithm.filter_groups.max_num_gen_batches={cap} gen "
            f"batches: the other groups' {self.filter.metric} was the same for every sample. Raise the cap "
            "(0 = no limit) or turn filter_groups off")

    # -- generation and scoring ------------------------------------------------------------------------

    async def _generate(self, gen_batch: GenBatch) -> None:
        """Generates the gen batch's groups, scores each chunk of complete groups as it fills, and resolves
        each group once scored (ready or filtered). Ahead of its step, all of it is one trace of its own."""
        try:
            if not gen_batch.ahead:  # in the `gen` phase of the step waiting for it
                gen_batch.trace = tracing.current_span_context()
                await self._generate_and_score(gen_batch)
                return
            with tracing.own_trace("generate", gen_batch=gen_batch.index, step=gen_batch.fill_step,
                                   weight_version=gen_batch.started_version) as context:
                gen_batch.trace = context
                await self._generate_and_score(gen_batch)
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self._fail(error)

    async def _generate_and_score(self, gen_batch: GenBatch) -> None:
        def from_fresh_weights(sample: FinishedSample) -> None:
            if sample.weight_version < gen_batch.started_version:
                raise FailedPrecondition(
                    f"a rollout replica generated a sample with weight version {sample.weight_version} after the "
                    f"weight sync of version {gen_batch.started_version}: it serves stale weights (staleness "
                    f"bound trainer.max_staleness {self.max_staleness})")

        rows = [group.row for group in gen_batch.groups]
        params = self.sampler.training_params(gen_batch.index)
        async for scored in self.sampler.generate_and_score(rows, params, on_sample=from_fresh_weights):
            for prompt_index, samples, results in scored:
                group = gen_batch.groups[prompt_index]
                group.samples, group.results = samples, results
                if group.state == GENERATING:  # not cancelled meanwhile
                    self._resolve(group)

    def _resolve(self, group: Group) -> None:
        """A scored group: ready for a step, or dropped by dynamic sampling."""
        group.resolved_at = time.perf_counter()
        if self.filter.enable and not self._varies(group):
            group.state = FILTERED
            self.counts["filtered"] += 1
        else:
            group.state = READY
            self.ready.append(group)
            self.counts["kept"] += 1
        self.changed.set()
        self._top_up()

    def _varies(self, group: Group) -> bool:
        metric = self.filter.metric
        values = []
        for index in range(self.n):
            result = group.results[index]
            if metric != "score" and metric not in result.metrics:
                raise FailedPrecondition(f"algorithm.filter_groups.metric {metric!r}: the scorer gave no such "
                                         f"output (it gave {sorted(result.metrics) or 'none'}); use score")
            values.append(result.score if metric == "score" else result.metrics[metric])
        return bool(filter_groups(torch.tensor(values, dtype=torch.float64), torch.zeros(self.n, dtype=torch.int64)).all())

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.changed.set()

    # -- what a step gets ------------------------------------------------------------------------------

    def _metrics(self, step: int, taken: list[Group], policy: int) -> dict[str, float]:
        """Staleness (by each sample's oldest token, and per token), partial rollouts, dropped groups and
        dynamic sampling's counts since the last step."""
        samples = [sample for group in taken for sample in group.samples]
        # [0.0] when none: agent episodes that recorded no call have no tokens to be stale
        staleness = torch.tensor([policy - sample.weight_version for sample in samples] or [0.0], dtype=torch.float32)
        # Per token, by runs of one version ([R] each): a sample's tokens as (version, count) spans
        spans = torch.tensor([span for sample in samples for span in sample.version_counts()] or [(policy, 0)],
                             dtype=torch.float64)
        run_staleness, run_tokens = policy - spans[:, 0], spans[:, 1]
        tokens = run_tokens.sum()
        if int(staleness.max()) > self.max_staleness or int(staleness.min()) < 0 or (
                tokens and int(run_staleness[run_tokens > 0].min()) < 0):
            versions = sorted({v for sample in samples for v, _ in sample.version_counts()})
            raise FailedPrecondition(f"step {step}: samples from weight versions {versions} but the actor is at "
                                     f"version {policy} (trainer.max_staleness {self.max_staleness})")
        metrics = {"rollout/staleness/mean": staleness.mean().item(), "rollout/staleness/max": staleness.max().item(),
                   "rollout/staleness/token_mean": ((run_staleness * run_tokens).sum() / tokens).item() if tokens else 0.0,
                   "rollout/partial_fraction": sum(bool(s.version_spans) for s in samples) / max(1, len(samples)),
                   "rollout/stale_groups": float(self.counts["stale"])}
        if self.filter.enable:
            metrics.update({"dynamic_sampling/kept_groups": float(self.counts["kept"]),
                            "dynamic_sampling/dropped_groups": float(self.counts["filtered"]),
                            "dynamic_sampling/gen_batches": float(self.gen_batches_per_step.get(step, 0))})
        self.counts = dict.fromkeys(self.counts, 0)
        return metrics

    @staticmethod
    def _layout(taken: list[Group], metrics: dict[str, float]) -> TakenGroups:
        rows, samples, results = [], [], {}
        for prompt_index, group in enumerate(taken):
            rows.append(group.row)
            for sample in group.samples:  # a taken group is done with: its samples move, uncopied, to the step
                sample.prompt_index = prompt_index
            samples += group.samples
            results.update({(prompt_index, index): result for index, result in group.results.items()})
        return TakenGroups(rows, samples, results, metrics)
