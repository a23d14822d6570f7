"""A generative judge (reward.judge): rollout services serving a judge model read each item through a prompt
template and write a verdict, whose parsed score is the item's reward.

The judge's user message is the template with the item's {prompt}, {response} and {ground_truth}; its rollout
service renders it with the judge model's chat template (Generate takes chat messages). Items queue from every
concurrent Score call and go out in Generate requests of at most judge.batch_size items, at most
judge.max_concurrency of them in flight, each bounded by judge.timeout_s. An item fails on its own, never hangs:
the judge unreachable (status error), past its deadline (status timeout), or a verdict with no score in it
(status error, "unparseable"); each failure is counted by reason and marked with the metric judge_failed.

The judge pool only generates: it is not in cluster.rollout, so no weight sync ever reaches it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections import deque
from collections.abc import Callable, Sequence

import grpc

from rlfabric.core.client import ChannelOptions, RoleInterface, ServiceClient
from rlfabric.core.config import JudgeConfig
from rlfabric.core.config.reward import JUDGE_FIELDS
from rlfabric.core.errors import DeadlineExceeded, RlfabricError
from rlfabric.reward.items import STATUS_ERROR, STATUS_TIMEOUT, ItemResult, ScoreItem, failed, short_message
from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

JUDGE_FAILED = "judge_failed"  # the item metric: 1.0 when the judge gave no score, else 0.0
# Why a judged item failed (the label of rlfabric_reward_judge_failures_total).
JUDGE_FAILURE_REASONS = ("unavailable", "timeout", "unparseable", "out_of_range", "error")
_FIELD = re.compile(r"\{(" + "|".join(JUDGE_FIELDS) + r")\}")
_JSON_OBJECT = re.compile(r"\{.*?\}", re.DOTALL)


class JudgeFailure(Exception):
    """The judge gave an item no score; `reason` is one of JUDGE_FAILURE_REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def render(template: str, item: ScoreItem) -> str:
    """The template with {prompt}, {response} and {ground_truth} replaced in one pass (so braces in the item's
    text are never read as fields); other braces stay."""
    values = {"prompt": item.prompt, "response": item.response, "ground_truth": str(item.ground_truth)}
    return _FIELD.sub(lambda match: values[match.group(1)], template)


def parse_score(verdict: str, config: JudgeConfig) -> float:
    """The score of a verdict, clamped to [min_score, max_score] (or JudgeFailure with out_of_range fail);
    JudgeFailure("unparseable") when the verdict holds none."""
    if config.parse == "regex":
        match = re.search(config.regex, verdict)
        text = match.group(1) if match else None
    else:
        text = _json_field(verdict, config.json_field)
    try:
        score = float(text) if text is not None else math.nan
    except (TypeError, ValueError):
        score = math.nan
    if not math.isfinite(score):
        rule = f"regex {config.regex!r}" if config.parse == "regex" else f"JSON field {config.json_field!r}"
        raise JudgeFailure("unparseable", f"judge: unparseable verdict (no number at {rule}): {verdict!r}")
    low, high = config.min_score, config.max_score
    if low <= score <= high:
        return score
    if config.out_of_range == "fail":
        raise JudgeFailure("out_of_range", f"judge: score {score:g} outside [{low:g}, {high:g}]: {verdict!r}")
    return min(max(score, low), high)


def _json_field(verdict: str, key: str) -> str | None:
    for match in _JSON_OBJECT.finditer(verdict):
        try:
            value = json.loads(match.group(0))
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and key in value and not isinstance(value[key], bool):
            return value[key]
    return None


class JudgeClient(ServiceClient, RoleInterface):
    """One judge replica: a rollout service's Generate, chat messages in, verdict texts out."""

    role = "judge"
    stub_class = rollout_pb2_grpc.RolloutServiceStub

    async def verdicts(
        self, conversations: Sequence[list[dict[str, str]]], config: JudgeConfig, timeout_s: float
    ) -> list[str]:
        """One verdict per conversation, in order."""
        sampling = rollout_pb2.SamplingParams(
            n=1,
            temperature=config.temperature,
            max_tokens=config.max_tokens,
            seed=config.seed,
            logprobs=False,
        )
        prompts = [
            rollout_pb2.Prompt(messages=[common_pb2.ChatMessage(**turn) for turn in turns])
            for turns in conversations
        ]
        request = rollout_pb2.RolloutServiceGenerateRequest(prompts=prompts, sampling_params=sampling)
        response = await self.call("Generate", request, timeout_s)
        texts: list[str | None] = [None] * len(conversations)
        for sample in response.samples:
            texts[sample.prompt_index] = sample.text
        if any(text is None for text in texts):
            raise RuntimeError(
                f"the judge answered {len(response.samples)} samples for {len(conversations)} prompts"
            )
        return texts  # type: ignore[return-value]  (every slot is filled by now)


class JudgeScorer:
    """Scores items with the judge pool: queued from concurrent calls, batched, concurrency- and time-bounded."""

    def __init__(
        self,
        config: JudgeConfig,
        options: ChannelOptions | None = None,
        on_failure: Callable[[str], None] = lambda reason: None,
    ):
        """on_failure(reason) is called once per failed item."""
        self.config = config
        self.on_failure = on_failure
        self.clients = [JudgeClient(address, options) for address in config.addresses]
        self._outstanding = {id(client): 0 for client in self.clients}
        self._queue: deque[tuple[ScoreItem, asyncio.Future]] = deque()
        self._in_flight: set[asyncio.Task] = set()
        self.requests = 0  # Generate requests sent so far

    def conversation(self, item: ScoreItem) -> list[dict[str, str]]:
        """The judge's chat messages for an item."""
        system = (
            [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        )
        return [*system, {"role": "user", "content": render(self.config.prompt_template, item)}]

    async def score(self, items: Sequence[ScoreItem]) -> list[ItemResult]:
        """One result per item, in order; a cancelled caller's queued items are never sent."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._queue.extend(zip(items, futures, strict=True))
        self._dispatch()
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise

    async def close(self) -> None:
        for task in list(self._in_flight):
            task.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in self.clients))

    def _dispatch(self) -> None:
        """Sends queued items while fewer than max_concurrency requests are in flight."""
        while self._queue and len(self._in_flight) < self.config.max_concurrency:
            batch = []
            while self._queue and len(batch) < self.config.batch_size:
                item, future = self._queue.popleft()
                if not future.cancelled():
                    batch.append((item, future))
            if batch:
                task = asyncio.create_task(self._judge(batch), name="reward-judge")
                self._in_flight.add(task)
                task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._in_flight.discard(task)
        self._dispatch()

    async def _judge(self, batch: list[tuple[ScoreItem, asyncio.Future]]) -> None:
        results = await self._results([item for item, _ in batch])
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():  # its caller may have gone away meanwhile
                future.set_result(result)

    async def _results(self, items: list[ScoreItem]) -> list[ItemResult]:
        try:
            verdicts = await self._generate([self.conversation(item) for item in items])
        except RlfabricError as error:
            timed_out = error.code == grpc.StatusCode.DEADLINE_EXCEEDED
            reason = (
                "timeout"
                if timed_out
                else "unavailable"
                if error.code == grpc.StatusCode.UNAVAILABLE
                else "error"
            )
            return [
                self._failed(reason, STATUS_TIMEOUT if timed_out else STATUS_ERROR, f"judge: {error}")
                for _ in items
            ]
        except Exception as error:  # e.g. a malformed answer: fails this batch's items, not the calls
            return [
                self._failed("error", STATUS_ERROR, f"judge: {type(error).__name__}: {error}") for _ in items
            ]
        results = []
        for verdict in verdicts:
            try:
                score = parse_score(verdict, self.config)
            except JudgeFailure as failure:
                results.append(self._failed(failure.reason, STATUS_ERROR, str(failure)))
                continue
            results.append(ItemResult(score=score, metrics={JUDGE_FAILED: 0.0}))
        return results

    async def _generate(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        """Verdicts from the least busy replica; one that is unreachable passes the request to the next, within
        one deadline of timeout_s."""
        self.requests += 1
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s
        errors = []
        ordered = sorted(self.clients, key=lambda c: self._outstanding[id(c)])
        for position, client in enumerate(ordered):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            self._outstanding[id(client)] += 1
            try:
                return await client.verdicts(conversations, self.config, remaining)
            except RlfabricError as error:
                if error.code != grpc.StatusCode.UNAVAILABLE or position == len(ordered) - 1:
                    raise
                errors.append(str(error))
            finally:
                self._outstanding[id(client)] -= 1
        raise DeadlineExceeded(
            short_message(
                f"no judge replica answered within reward.judge.timeout_s="
                f"{self.config.timeout_s:g} s: " + "; ".join(errors)
            )
        )

    def _failed(self, reason: str, status: str, message: str) -> ItemResult:
        self.on_failure(reason)
        result = failed(status, message)
        result.metrics[JUDGE_FAILED] = 1.0
        return result
