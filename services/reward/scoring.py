"""Batch scoring: the one entry point the reward service calls, plus VeRL's compute_score.

A batch can be stopped half-way (a `cancelled` event, set when the caller gave up): the items not
started yet are never scored. Rule-based scorers can run on watched threads (ScorerThreads), so a
scorer that hangs costs its item a "timeout", not the batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfabric.reward.items import (
    STATUS_ERROR,
    STATUS_TIMEOUT,
    ItemResult,
    ScoreItem,
    describe_exception,
    failed,
    result_from_value,
)
from rlfabric.reward.overlong import OverlongConfig, apply_overlong_penalty
from rlfabric.reward.registry import Scorer, UnknownDataSourceError, get_scorer

if TYPE_CHECKING:
    from rlfabric.reward.custom import CustomScorerPool


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict:
    """VeRL's default_compute_score: score one response with the scorer registered for data_source.

    kwargs go to the scorer (e.g. method="flexible" for GSM8K). Returns a float, or the scorer's
    dict unchanged. Raises UnknownDataSourceError (a NotImplementedError) for an unknown data_source.
    """
    result = get_scorer(data_source)(solution_str, ground_truth, extra_info, **kwargs)
    if isinstance(result, dict):
        return result
    if isinstance(result, (int, float, bool)):
        return float(result)
    return float(result[0])


# The name VeRL users import.
default_compute_score = compute_score


@dataclass
class ScoringConfig:
    """How score_items scores a batch."""

    compute_score_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for every rule-based scorer (VeRL: reward.compute_score_kwargs)."""
    default_score_for_unknown: float | None = None
    """Score for a data_source with no scorer; None makes such a batch fail with UnknownDataSourceError."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO overlong penalty, added to every successfully scored item when enabled."""
    custom_chunk: int = 0
    """With a custom pool and a `cancelled` event: items per pool call, so a cancelled batch stops
    within one chunk (0 = the whole batch in one call)."""


class ScoringCancelled(Exception):
    """The caller gave up on the batch; the items not started by then were not scored."""


class ScorerThreads:
    """Runs rule-based scorers off the caller's thread, each call bounded by timeout_s.

    A batch's items run one after another on a thread of its own that the caller watches. Python
    cannot kill a thread: a scorer still running after timeout_s gets status "timeout", its thread is
    abandoned (it runs on until the scorer returns, and what it returns is dropped) and the rest of
    the batch goes on on a new thread. While max_stuck abandoned threads are still running, every
    item gets "timeout" at once instead of another thread: they hold memory and maybe a core each,
    and only their scorers returning, or a restart of the service, gets them back.
    """

    def __init__(self, timeout_s: float, max_stuck: int):
        self.timeout_s, self.max_stuck = timeout_s, max_stuck
        self._lock = threading.Lock()
        self.stuck = 0  # abandoned threads still running a scorer

    def score(self, items: Sequence[ScoreItem], score_one: Callable[[ScoreItem], ItemResult],
              cancelled: threading.Event | None = None) -> list[ItemResult]:
        """One result per item, in order; ScoringCancelled once `cancelled` is set."""
        results: list[ItemResult | None] = [None] * len(items)
        start = 0
        while start < len(items):
            with self._lock:
                stuck = self.stuck
            if stuck >= self.max_stuck:
                message = (f"not scored: {stuck} scorer threads are still stuck in calls that timed out "
                           "(reward.max_stuck_scorer_threads), until they return or the service restarts")
                results[start:] = [failed(STATUS_TIMEOUT, message) for _ in items[start:]]
                break
            run = _Run(start)
            threading.Thread(target=self._run, args=(run, items, results, score_one, cancelled),
                             name=f"scorer-{id(run):x}", daemon=True).start()
            start = self._watch(run)
            if run.abandoned:  # its scorer overran
                results[start] = failed(STATUS_TIMEOUT, f"the scorer did not return within reward.timeout_s="
                                                        f"{self.timeout_s:g} s; its thread was abandoned")
                start += 1
            if start < len(items) and cancelled is not None and cancelled.is_set():
                raise ScoringCancelled(f"scoring cancelled after {start} of {len(items)} items")
        return results  # type: ignore[return-value]  (every slot is filled by now)

    def _run(self, run: _Run, items, results, score_one, cancelled) -> None:
        index = run.index
        try:
            while index < len(items) and not (cancelled is not None and cancelled.is_set()):
                try:
                    result = score_one(items[index])
                except BaseException as exc:  # even SystemExit from a scorer fails only its item
                    result = failed(STATUS_ERROR, describe_exception(exc))
                with run.changed:
                    if run.abandoned:
                        return
                    results[index] = result
                    index += 1
                    run.index, run.started = index, time.monotonic()
        finally:
            with run.changed:
                run.done = True
                run.changed.notify()
                if run.abandoned:
                    with self._lock:
                        self.stuck -= 1

    def _watch(self, run: _Run) -> int:
        """Waits until the run ends or its current item overruns (then abandons it); the index where
        it stopped."""
        with run.changed:
            while not run.done:
                # run.started moves on without a notify: waking once per timeout_s is enough
                remaining = run.started + self.timeout_s - time.monotonic()
                if remaining <= 0:
                    run.abandoned = True
                    with self._lock:
                        self.stuck += 1
                    break
                run.changed.wait(remaining)
            return run.index


class _Run:
    """What a ScorerThreads thread has done, shared with its watcher under `changed`."""

    def __init__(self, start: int):
        self.changed = threading.Condition()
        self.index = start  # the item being scored (or the next one)
        self.started = time.monotonic()  # when that item started
        self.done = False
        self.abandoned = False


def score_items(
    items: Sequence[ScoreItem],
    config: ScoringConfig | None = None,
    custom_pool: CustomScorerPool | None = None,
    cancelled: threading.Event | None = None,
    threads: ScorerThreads | None = None,
) -> list[ItemResult]:
    """Score a batch, one ItemResult per item in order.

    With a custom_pool every item goes to the user's function (as VeRL's custom_reward_function
    replaces default_compute_score); otherwise each item's registered scorer runs in this process,
    on `threads` when given (each call bounded by its timeout), else on the caller's thread.
    A scorer that raises gives that item status "error" and score 0. The overlong penalty is
    added to "ok" items only (failed items keep score 0) and logged as metrics
    "overlong_reward" and "overlong" (1.0 when penalised), as VeRL's DAPO reward manager does.
    Raises ScoringCancelled, leaving the items not started unscored, once `cancelled` is set.
    """
    config = config or ScoringConfig()
    if custom_pool is not None:
        results = _score_with_pool(items, custom_pool, config.custom_chunk, cancelled)
    else:
        results = _score_in_process(items, config, cancelled, threads)

    add_overlong_penalty(items, results, config.overlong)
    return results


def add_overlong_penalty(
    items: Sequence[ScoreItem], results: list[ItemResult], config: OverlongConfig
) -> None:
    """Add the overlong penalty to the "ok" results in place, with metrics "overlong_reward" and
    "overlong"; nothing happens when the config is disabled."""
    if not config.enable:
        return
    for item, result in zip(items, results, strict=True):
        if not result.ok:
            continue
        result.score, penalty = apply_overlong_penalty(result.score, item.response_length, config)
        result.metrics["overlong_reward"] = penalty
        result.metrics["overlong"] = float(penalty < 0)


def _score_with_pool(items: Sequence[ScoreItem], pool: CustomScorerPool, chunk: int,
                     cancelled: threading.Event | None) -> list[ItemResult]:
    if cancelled is None or chunk <= 0:
        return pool.score_batch(items)
    results: list[ItemResult] = []
    for start in range(0, len(items), chunk):
        if cancelled.is_set():
            raise ScoringCancelled(f"scoring cancelled after {start} of {len(items)} items")
        results += pool.score_batch(items[start : start + chunk])
    return results


def _score_in_process(items: Sequence[ScoreItem], config: ScoringConfig, cancelled: threading.Event | None,
                      threads: ScorerThreads | None) -> list[ItemResult]:
    # Resolve each data_source once, so an unknown one fails the batch before anything runs.
    scorers: dict[str, Scorer | None] = {}
    for data_source in sorted({item.data_source for item in items}):
        try:
            scorers[data_source] = get_scorer(data_source)
        except UnknownDataSourceError:
            if config.default_score_for_unknown is None:
                raise
            scorers[data_source] = None

    kwargs = config.compute_score_kwargs

    def score_one(item: ScoreItem) -> ItemResult:
        scorer = scorers[item.data_source]
        if scorer is None:
            message = f"no scorer for data_source {item.data_source!r}; default score used"
            return ItemResult(score=float(config.default_score_for_unknown), message=message)
        try:
            value = scorer(item.response, item.ground_truth, item.extra_info, **kwargs)
        except Exception as exc:  # a scorer's bug fails its item, not the batch
            return failed(STATUS_ERROR, describe_exception(exc))
        return result_from_value(value)

    if threads is not None:
        return threads.score(items, score_one, cancelled)
    results = []
    for index, item in enumerate(items):
        if cancelled is not None and cancelled.is_set():
            raise ScoringCancelled(f"scoring cancelled after {index} of {len(items)} items")
        results.append(score_one(item))
    return results
