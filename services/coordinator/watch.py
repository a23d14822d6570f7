"""Following a run from a client: the progress bar (step, reward, ETA) `rlfabric train` draws, or a line per
step, from the coordinator's StreamMetrics: `status = await watch_run(client, 20)`. The coordinator's own
output goes to RUN_DIR/logs/coordinator.log; this runs in the caller's process."""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from tqdm import tqdm

from rlfabric.coordinator.client import CoordinatorInterface
from rlfabric.core.errors import DeadlineExceeded
from rlfabric.v1 import coordinator_pb2


def step_line(message: coordinator_pb2.CoordinatorServiceStreamMetricsResponse, total_steps: int) -> str:
    """"step 3/10 critic/score/mean=0.41 actor/pg_loss=-0.02 ...": a few of the step's metrics."""
    keys = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "response_length/mean", "timing_s/step")
    shown = [f"{key}={message.metrics[key]:.4g}" for key in keys if key in message.metrics]
    return " ".join([f"step {message.step}/{total_steps}", *shown])


async def watch_run(
    client: CoordinatorInterface,
    total_steps: int,
    start_step: int = 0,
    *,
    progress_bar: bool = True,
    step_lines: bool = False,
    file: TextIO | None = None,
) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
    """Follows a run through StreamMetrics with a tqdm bar (step, reward, ETA), or a printed line per step
    (step_lines: for logs, e.g. a Kubernetes Job's); returns its final status.

    The stream carries the client's deadline, so a run that outlasts it
    is followed by reopening the stream from the next step.
    """
    running = (coordinator_pb2.RUN_STATE_RUNNING, coordinator_pb2.RUN_STATE_PAUSED)
    next_step = start_step + 1
    with tqdm(total=total_steps, initial=start_step, unit="step", desc="training", dynamic_ncols=True,
              file=file or sys.stderr, disable=not progress_bar) as bar:
        while True:
            try:
                async for message in client.stream_metrics(from_step=next_step):
                    if message.step < next_step:
                        continue
                    reward = message.metrics.get("critic/score/mean")
                    if reward is not None:
                        bar.set_postfix(reward=f"{reward:.3f}", refresh=False)
                    if step_lines:
                        print(step_line(message, total_steps), flush=True)
                    bar.update(message.step - bar.n)
                    next_step = message.step + 1
            except DeadlineExceeded:
                continue
            status = await client.run_status()
            if status.state not in running:
                return status
            await asyncio.sleep(1.0)  # the stream ended early but the run goes on: reopen it
