"""RewardEngine: what the reward service runs behind its servicer.

Four kinds of scorer, and a ScorerRouter that sends each item to one of them by its data_source
(as VeRL's RewardManager does: rules for math, a reward model for dialogue), within one request:
- the reward model (reward.model_path; imports torch): the items of reward.model_sources, in forward
  passes shared by concurrent Score calls (ModelBatcher);
- the user's function (reward.custom_path; a sandboxed worker pool): the items of reward.custom_sources;
- a generative judge (reward.judge.addresses; rollout services serving a judge model, rlfabric.reward.judge):
  the items of reward.judge.data_sources;
- the rule-based scorer registered for the item's data_source (GSM8K, MATH, HellaSwag, anything
  register_scorer added), run on a watched thread of this process: every other item.
A configured model, custom function or judge with an empty source list takes every item the others'
lists do not name, so one of them alone scores everything (VeRL's default).

A request is validated as a whole before anything is scored (a bad item fails the request with
InvalidArgument naming it); a scorer that fails fails only its items (status error/timeout/crashed).
A request whose caller goes away (cancelled, or past its deadline) stops: the items not started by
then are never scored, so the workers and threads are free for the next one.
torch is imported only when a reward model or a tokenizer is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import RewardConfig
from rlfabric.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from rlfabric.core.metrics import service_counter
from rlfabric.reward.custom import CustomScorerPool
from rlfabric.reward.items import STATUS_CRASHED, STATUS_ERROR, STATUS_TIMEOUT, ItemResult, ScoreItem
from rlfabric.reward.judge import JUDGE_FAILURE_REASONS, JudgeScorer
from rlfabric.reward.model_batcher import ModelBatcher
from rlfabric.reward.overlong import OverlongConfig
from rlfabric.reward.registry import (
    SCORER_FAMILIES,
    UnknownDataSourceError,
    has_scorer,
    load_scorer_modules,
    registered_data_sources,
)
from rlfabric.reward.scoring import (
    ScorerThreads,
    ScoringConfig,
    add_overlong_penalty,
    score_items,
)

FAILURE_REASONS = (STATUS_ERROR, STATUS_TIMEOUT, STATUS_CRASHED)
RULES, CUSTOM, MODEL, JUDGE = "rules", "custom", "model", "judge"  # the routes of ScorerRouter

log = logging.getLogger("rlfabric.reward")


@dataclasses.dataclass
class RewardStatus:
    """What GetStatus reports."""

    data_sources: list[str]
    """data_source values with a registered rule-based scorer."""
    items_scored: int
    """Items scored since start, failed ones included."""
    items_failed: int
    """Items whose scorer failed (error, timeout or crash) since start."""


@dataclasses.dataclass(frozen=True)
class ScorerRouter:
    """Which scorer takes an item, by its data_source: a listed source goes to the scorer that lists
    it; any other goes to a configured scorer whose list is empty (it takes every other item), else
    to the rules. The config allows at most one empty list among the configured scorers."""

    custom_sources: frozenset[str] | None
    """Sources of the custom function; None = no custom function, empty = every other item."""
    model_sources: frozenset[str] | None
    """Sources of the reward model; None = no reward model, empty = every other item."""
    judge_sources: frozenset[str] | None = None
    """Sources of the judge; None = no judge, empty = every other item."""

    @classmethod
    def from_config(cls, config: RewardConfig) -> ScorerRouter:
        return cls(frozenset(config.custom_sources) if config.custom_path else None,
                   frozenset(config.model_sources) if config.model_path else None,
                   frozenset(config.judge.data_sources) if config.judge.addresses else None)

    def route(self, data_source: str) -> str:
        """RULES, CUSTOM, MODEL or JUDGE."""
        routes = ((CUSTOM, self.custom_sources), (MODEL, self.model_sources), (JUDGE, self.judge_sources))
        for route, sources in routes:
            if sources and data_source in sources:
                return route
        for route, sources in routes:
            if sources == frozenset():
                return route
        return RULES

    def split(self, items: Sequence[ScoreItem]) -> dict[str, list[int]]:
        """The indices of the items each route takes (routes with no items left out)."""
        groups: dict[str, list[int]] = {}
        for index, item in enumerate(items):
            groups.setdefault(self.route(item.data_source), []).append(index)
        return groups


def unscored_sources(config: RewardConfig, sources: Iterable[str]) -> list[str]:
    """The data sources no scorer takes, sorted: routed to the rules (ScorerRouter) with none registered for
    them (scorers registered until now count), when reward.default_score_for_unknown is not set."""
    if config.default_score_for_unknown is not None:
        return []
    router = ScorerRouter.from_config(config)
    return sorted(source for source in set(sources) if router.route(source) == RULES and not has_scorer(source))


def unscored_sources_advice(config: RewardConfig, unscored: Sequence[str]) -> str:
    """What an error says about data sources no scorer takes (unscored_sources)."""
    other = [f"reward.{key}" for key, path in (("model_sources", config.model_path),
                                               ("custom_sources", config.custom_path),
                                               ("judge.data_sources", config.judge.addresses)) if path]
    extras = [f"; {prefix}* scorers come with pip install 'rlfabric[{extra}]'"
              for prefix, (_, extra) in SCORER_FAMILIES.items() if any(s.startswith(prefix) for s in unscored)]
    return (f"unknown data_source {', '.join(map(repr, unscored))}; registered: "
            f"{', '.join(registered_data_sources())} (or set reward.default_score_for_unknown"
            + "".join(f", or list it in {key}" for key in other) + ")" + "".join(extras))


class RewardEngine:
    """Scores batches of ScoreItems; start() loads the tokenizer, custom pool or reward model."""

    def __init__(
        self, config: RewardConfig, registry: CollectorRegistry | None = None, max_response_length: int = 1024,
        judge_options: ChannelOptions | None = None,
    ):
        """max_response_length is the overlong penalty's Lmax when the reward config leaves it 0; judge_options:
        how the judge pool is reached (the mesh's TLS and token)."""
        self.config = config
        self.router = ScorerRouter.from_config(config)  # RewardConfig checked that the routes do not overlap
        self.scoring = ScoringConfig(
            compute_score_kwargs=dict(config.compute_score_kwargs),
            default_score_for_unknown=config.default_score_for_unknown,
            overlong=OverlongConfig(
                enable=config.overlong_enable,
                max_response_length=config.overlong_max_response_length or max_response_length,
                buffer_length=config.overlong_buffer_length,
                penalty_factor=config.overlong_penalty_factor,
            ),
            custom_chunk=config.num_workers,  # a cancelled request stops after one item per worker
        )
        self.scorer_threads = ScorerThreads(config.timeout_s, config.max_stuck_scorer_threads)
        self.custom_pool: CustomScorerPool | None = None
        self.reward_model: Any = None  # RewardModelScorer, typed loosely to keep torch out of this module
        self.tokenizer: Any = None  # transformers tokenizer decoding response_token_ids
        self.vocab_size = 0  # ids in [0, vocab_size) can be decoded
        self.items_scored = 0
        self.items_failed = 0
        registry = registry if registry is not None else CollectorRegistry()
        self._items_total = service_counter(
            registry,
            "rlfabric_reward_items_total",
            "Items scored by the reward service, failed ones included.",
        )
        self._failures_total = service_counter(
            registry, "rlfabric_reward_failures_total", "Items whose scorer failed, by reason.", ("reason",)
        )
        for reason in FAILURE_REASONS:  # export 0 from the start, so rate() works from the first failure
            self._failures_total.labels(reason=reason)
        self._judge_failures_total = service_counter(
            registry, "rlfabric_reward_judge_failures_total",
            "Items the generative judge gave no score, by reason.", ("reason",))
        for reason in JUDGE_FAILURE_REASONS:
            self._judge_failures_total.labels(reason=reason)
        self.model_batcher = ModelBatcher(self._score_model_batch, config.model_batch_size)
        self.judge: JudgeScorer | None = None
        self._judge_options = judge_options
        self._started = False

    # --- lifecycle ---

    async def start(self) -> None:
        """Import scorer modules, then load what the config asks for (off the event loop: health stays live)."""
        config = self.config
        load_scorer_modules(config.scorer_modules)  # their register_scorer calls run now
        if config.tokenizer_path:
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, config.tokenizer_path)
            self.vocab_size = len(self.tokenizer)  # added special tokens included
        if config.custom_path:
            self.custom_pool = await asyncio.to_thread(
                CustomScorerPool,
                config.custom_path,
                config.custom_name,
                num_workers=config.num_workers,
                timeout_s=config.timeout_s,
                memory_limit_mb=config.memory_limit_mb or None,
                function_kwargs=dict(config.custom_kwargs),
                sandbox=config.custom_sandbox,
                signature=config.custom_signature,
            )
        if config.model_path:
            self.reward_model = await asyncio.to_thread(_load_reward_model, config)
        if config.judge.addresses:
            self.judge = JudgeScorer(config.judge, self._judge_options, self._count_judge_failure)
        self._started = True

    async def stop(self) -> None:
        """Kill the custom-function workers and drop the model."""
        self._started = False
        if self.custom_pool is not None:
            await asyncio.to_thread(self.custom_pool.close)
            self.custom_pool = None
        self.reward_model = None
        self.tokenizer = None
        if self.judge is not None:
            await self.judge.close()
            self.judge = None

    # --- scoring ---

    def check_batch_size(self, count: int) -> None:
        """InvalidArgument for an empty batch, ResourceExhausted for one above max_items_per_request."""
        if count == 0:
            raise InvalidArgument("Score needs at least one item")
        if count > self.config.max_items_per_request:
            raise ResourceExhausted(
                f"{count} items in one request; the limit is reward.max_items_per_request="
                f"{self.config.max_items_per_request}: split the batch"
            )

    async def score(self, items: Sequence[ScoreItem]) -> list[ItemResult]:
        """One result per item, in order. Nothing is scored if any item is invalid."""
        if not self._started:
            raise Unavailable("the reward engine is not started (or already stopped)")
        # 1. Validate the whole batch: size, token ids (decoded here), the data sources the rules take.
        self.check_batch_size(len(items))
        items = await self._resolve_responses(items)
        routes = self.router.split(items)
        self._check_data_sources(items, routes.get(RULES, []))

        # 2. Score each route's items with its scorer, never on the event loop; results in item order.
        by_index: dict[int, ItemResult] = {}
        for route, indices in routes.items():
            part = [items[index] for index in indices]
            by_index.update(zip(indices, await self._score_route(route, part), strict=True))
        results = [by_index[index] for index in range(len(items))]

        # 3. Count.
        self._record(results)
        return results

    async def _score_route(self, route: str, items: list[ScoreItem]) -> list[ItemResult]:
        if route == MODEL:
            results = await self.model_batcher.score(items)
            add_overlong_penalty(items, results, self.scoring.overlong)
            return results
        if route == JUDGE:
            results = await self.judge.score(items)
            add_overlong_penalty(items, results, self.scoring.overlong)
            return results
        if route == CUSTOM:
            return await _until_cancelled(score_items, items, self.scoring, self.custom_pool)
        try:
            return await _until_cancelled(score_items, items, self.scoring, threads=self.scorer_threads)
        except UnknownDataSourceError as error:  # the registry changed since step 1
            raise InvalidArgument(str(error)) from None

    def status(self) -> RewardStatus:
        return RewardStatus(registered_data_sources(), self.items_scored, self.items_failed)

    def _score_model_batch(self, items: list[ScoreItem]) -> list[ItemResult]:
        """One reward-model forward pass (on a ModelBatcher thread)."""
        return self.reward_model.score_items(items)

    def _check_data_sources(self, items: Sequence[ScoreItem], rule_indices: Sequence[int]) -> None:
        """InvalidArgument for the first of the items the rules take whose data_source has no rule."""
        unscored = unscored_sources(self.config, {items[index].data_source for index in rule_indices})
        for index in rule_indices:
            if items[index].data_source in unscored:
                raise InvalidArgument(f"item {index}: {unscored_sources_advice(self.config, [items[index].data_source])}")

    async def _resolve_responses(self, items: Sequence[ScoreItem]) -> Sequence[ScoreItem]:
        """Items with token ids get their response_length (when 0) and, if response is empty, their
        text decoded with the tokenizer. The caller's items are not changed."""
        to_decode: list[int] = []
        has_token_ids = False
        for index, item in enumerate(items):
            if not len(item.response_token_ids):
                continue
            has_token_ids = True
            if item.response:
                continue
            if self.tokenizer is None:
                raise InvalidArgument(
                    f"item {index}: response is empty and response_token_ids needs a tokenizer to decode, "
                    "but this reward service has none (set reward.tokenizer_path, or send the text)"
                )
            self._check_token_ids(index, item.response_token_ids)
            to_decode.append(index)
        if not has_token_ids:
            return items

        texts = []
        if to_decode:
            id_lists = [list(items[index].response_token_ids) for index in to_decode]
            # As VeRL's reward managers decode: special tokens (EOS, padding) are not part of the text.
            texts = await asyncio.to_thread(self.tokenizer.batch_decode, id_lists, skip_special_tokens=True)
        decoded = dict(zip(to_decode, texts, strict=True))
        resolved = []
        for index, item in enumerate(items):
            changes: dict[str, Any] = {}
            if index in decoded:
                changes["response"] = decoded[index]
            if item.response_length == 0 and len(item.response_token_ids):
                changes["response_length"] = len(item.response_token_ids)
            resolved.append(dataclasses.replace(item, **changes) if changes else item)
        return resolved

    def _check_token_ids(self, index: int, token_ids: Sequence[int]) -> None:
        vocab_size = self.vocab_size
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise InvalidArgument(
                f"item {index}: response_token_ids holds {bad}, outside the tokenizer's vocabulary [0, {vocab_size})"
            )

    def _count_judge_failure(self, reason: str) -> None:
        self._judge_failures_total.labels(reason=reason).inc()

    def _record(self, results: Sequence[ItemResult]) -> None:
        failures = Counter(result.status for result in results if not result.ok)
        self.items_scored += len(results)
        self.items_failed += sum(failures.values())
        self._items_total.inc(len(results))
        for reason, count in failures.items():
            self._failures_total.labels(reason=reason).inc(count)


async def _until_cancelled(fn, *args, **kwargs):
    """fn(*args, cancelled=event, **kwargs) on a thread. When the caller is cancelled, the event tells
    fn to stop at its next item, and the caller waits for that, so nothing of the request still runs
    when its cancellation goes on."""
    cancelled = threading.Event()
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args, cancelled=cancelled, **kwargs))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        cancelled.set()
        log.info("Score cancelled: its caller went away; the items not started are not scored")
        with contextlib.suppress(BaseException):  # ScoringCancelled, or a second cancellation
            await work
        raise


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # imports torch: only when token ids are to be decoded

    return AutoTokenizer.from_pretrained(path)


def _load_reward_model(config: RewardConfig) -> Any:
    from rlfabric.reward.model_reward import ModelRewardConfig, RewardModelScorer  # imports torch

    return RewardModelScorer(
        ModelRewardConfig(
            model_path=config.model_path,
            tokenizer_path=config.model_tokenizer_path or None,
            device=config.model_device,
            dtype=config.model_dtype,
            batch_size=config.model_batch_size,
            max_length=config.model_max_length or None,
        )
    )
