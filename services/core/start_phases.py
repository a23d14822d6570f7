"""How long each phase of a start took: the launcher's (`rlfabric up`/`train`: config, model, services,
readiness) and a run's (StartRun to its first Generate: data, tokenizer and model checks, connections,
initial weights, weight-sync group, first sync). A start with no log line for half a minute says nothing
about where the time went; with these, every phase logs one line with its seconds when it ends.

    phases = StartPhases("run")
    with phases.phase("data"):
        ...
    tokenizer, peers = await asyncio.gather(phases.timed("tokenizer", load()), phases.timed("connect", connect()))
    phases.finish()                       # the end of the start: one line with the total
    phases.metrics()                      # {"timing_s/start/data": 0.41, ..., "timing_s/start/total": 3.2}
    phases.summary()                      # what RUN_DIR/run_start.json holds

Phases that run concurrently overlap in time; each records where it began (start_s, seconds since the
start) as well as its length, so the summary also says how much of the start no phase covered
(`unaccounted_s`): the part nobody logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

METRIC_PREFIX = "timing_s/start/"


@dataclass
class Phase:
    """One phase of a start: where it began (seconds since the start) and how long it took."""

    name: str
    start_s: float
    seconds: float


class StartPhases:
    """The phases of one start (`what`: "run", "mesh"), in the order they began, logged as they end."""

    def __init__(self, what: str, logger: logging.Logger | None = None):
        self.what = what
        self.log = logger or logging.getLogger("rlfabric.start")
        self.started = time.perf_counter()
        self.phases: list[Phase] = []
        self.total_s: float | None = None  # set by finish()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as phase `name`; its line is logged when it ends (also when it fails)."""
        began = time.perf_counter()
        entry = Phase(name, began - self.started, 0.0)
        self.phases.append(entry)
        failed = True
        try:
            yield
            failed = False
        finally:
            entry.seconds = time.perf_counter() - began
            fields = {"phase": name, "seconds": round(entry.seconds, 3), "since_start_s": round(entry.start_s, 3)}
            if failed:
                fields["failed"] = True
            self.log.info(f"{self.what} start: {name} took {entry.seconds:.2f} s", extra={"fields": fields})

    async def timed(self, name: str, call: Awaitable[T]) -> T:
        """Awaits `call` as phase `name` (for phases that run side by side under asyncio.gather)."""
        with self.phase(name):
            return await call

    def finish(self) -> float:
        """The start is over: logs and returns its total seconds (once; later calls return the same)."""
        if self.total_s is None:
            self.total_s = time.perf_counter() - self.started
            self.log.info(f"{self.what} start took {self.total_s:.2f} s", extra={"fields": {
                "total_s": round(self.total_s, 3), "unaccounted_s": round(self.unaccounted_s(), 3),
                "phases_s": self.seconds()}})
        return self.total_s

    def seconds(self) -> dict[str, float]:
        """{phase: seconds}; a phase that ran more than once counts its total."""
        out: dict[str, float] = {}
        for phase in self.phases:
            out[phase.name] = round(out.get(phase.name, 0.0) + phase.seconds, 3)
        return out

    def unaccounted_s(self) -> float:
        """Seconds of the start (to finish(), or now) that no phase covered."""
        end = self.total_s if self.total_s is not None else time.perf_counter() - self.started
        covered, reached = 0.0, 0.0
        for phase in sorted(self.phases, key=lambda p: p.start_s):
            begin, finish = max(phase.start_s, reached), min(phase.start_s + phase.seconds, end)
            if finish > begin:
                covered += finish - begin
                reached = finish
        return max(0.0, end - covered)

    def metrics(self) -> dict[str, float]:
        """timing_s/start/<phase> for every phase, and timing_s/start/total once finished."""
        metrics = {METRIC_PREFIX + name: seconds for name, seconds in self.seconds().items()}
        if self.total_s is not None:
            metrics[METRIC_PREFIX + "total"] = self.total_s
        return metrics

    def summary(self, **extra) -> dict:
        """The phases in the order they began, their seconds, the total and what no phase covered."""
        return {"what": self.what, "total_s": self.total_s, "unaccounted_s": round(self.unaccounted_s(), 3),
                "phases": [asdict(phase) for phase in self.phases], "phases_s": self.seconds(), **extra}

    def write(self, path: Path, **extra) -> None:
        """The summary as JSON at `path`, replaced atomically."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.summary(**extra), indent=2) + "\n")
        tmp.replace(path)
