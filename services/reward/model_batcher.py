"""ModelBatcher: reward-model forward passes shared by concurrent Score calls.

Every call queues its items; one worker task takes up to batch_size queued items at a time, from
whichever calls queued them, and runs one forward pass on a thread. A GPU then sees full batches
even when each caller sends a few items, and only one forward runs at a time. A call that goes
away (cancelled, or past its deadline) takes its queued items out of the queue: they are never
scored. A forward that raises fails only the items in it (status "error").
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence

from rlfabric.reward.items import STATUS_ERROR, ItemResult, ScoreItem, describe_exception, failed

log = logging.getLogger("rlfabric.reward")


class ModelBatcher:
    """Scores items with score_batch (one forward, a thread) in batches of up to batch_size items."""

    def __init__(self, score_batch: Callable[[list[ScoreItem]], list[ItemResult]], batch_size: int):
        self.score_batch = score_batch
        self.batch_size = batch_size
        self.forwards = 0  # forward passes run so far
        self._queue: deque[tuple[ScoreItem, asyncio.Future]] = deque()
        self._worker: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        """Items waiting for a forward pass."""
        return len(self._queue)

    async def score(self, items: Sequence[ScoreItem]) -> list[ItemResult]:
        """One result per item, in order, once every item has been through a forward pass."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._queue.extend(zip(items, futures, strict=True))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run(), name="reward-model-batcher")
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for future in futures:  # the worker skips items whose future is cancelled
                future.cancel()
            raise

    async def _run(self) -> None:
        """Forward passes until the queue is empty; the next call that queues starts a new worker."""
        while self._queue:
            batch: list[tuple[ScoreItem, asyncio.Future]] = []
            while self._queue and len(batch) < self.batch_size:
                item, future = self._queue.popleft()
                if not future.cancelled():
                    batch.append((item, future))
            if not batch:
                continue
            results = await asyncio.to_thread(self._forward, [item for item, _ in batch])
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():  # its caller may have gone away during the forward
                    future.set_result(result)

    def _forward(self, items: list[ScoreItem]) -> list[ItemResult]:
        self.forwards += 1
        try:
            results = self.score_batch(items)
            if len(results) != len(items):
                raise RuntimeError(f"{len(results)} results for {len(items)} items")
            return results
        except Exception as exc:  # e.g. out of memory: fails this batch's items, not the calls
            log.warning("the reward model failed on %d items: %s", len(items), describe_exception(exc))
            return [failed(STATUS_ERROR, describe_exception(exc)) for _ in items]
