"""The hybrid engine (trainer.colocated): the rollout shares its devices with the trainers (one resource pool),
so it holds its memory only while it generates.

A step, in VeRL's order:
1. generate (the rollout is awake), then Sleep every replica: level 2 (the weights' memory is freed too) when
   every sync sends the full weights, level 1 (weights offloaded) when syncs send LoRA adapters only;
2. the trainers compute and update on the freed devices;
3. WakeUp(["weights"]) (the weights' memory comes back), the weight sync fills it, WakeUp(["kv_cache"]):
   the KV cache comes back only after the sync, so the sync never competes with it for memory.

Memory is read from each replica's GetStatus around the phases (the largest over replicas) and reported
as memory/rollout/{rss,device}_mb/{generated,asleep,synced}: the process's RSS and what the engine holds
on its device by its own accounting (GPU memory on a GPU). The actor's side comes with its update's metrics
(memory/actor/*, rlfabric.trainer.engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rlfabric.core.config import RunConfig
from rlfabric.rollout.types import EngineStatus

MB = 1 << 20


def sleep_level(config: RunConfig) -> int:
    """2 when every weight sync sends the full weights (the engine may discard its own); else 1."""
    return 1 if config.syncs_lora_adapters() else 2


async def wake_sleeping(rollout) -> None:
    """At the start of every run, colocated or not: a replica a stopped colocated run left asleep wakes up
    whole (a run that does not sleep its replicas would otherwise sync into freed weights and wait forever
    for generation). `rollout` is the RolloutRouter."""
    statuses = await rollout.status()
    asleep = {address for address, status in statuses.items() if isinstance(status, EngineStatus) and status.sleeping}
    if asleep:
        await asyncio.gather(*(r.client.wake_up() for r in rollout.healthy() if r.address in asleep))


class HybridEngine:
    """Sleep and WakeUp of the rollout replicas around a colocated step, and the memory of each phase."""

    def __init__(self, config: RunConfig, rollout):
        self.rollout = rollout  # the RolloutRouter: healthy() replicas, status()
        self.level = sleep_level(config)
        self._memory: dict[str, float] = {}

    async def sleep(self) -> None:
        """After generation: every replica releases its memory for the trainers."""
        await self._measure("generated")
        await asyncio.gather(*(r.client.sleep(self.level) for r in self.rollout.healthy()))
        await self._measure("asleep")

    async def wake_weights(self) -> None:
        """Before the weight sync: the weights' memory comes back (empty after level 2)."""
        await self._wake(["weights"])

    async def wake_kv_cache(self) -> None:
        """After the weight sync: the KV cache comes back and the replicas generate again."""
        await self._wake(["kv_cache"])
        await self._measure("synced")

    async def _wake(self, tags: Sequence[str]) -> None:
        await asyncio.gather(*(r.client.wake_up(tags) for r in self.rollout.healthy()))

    async def _measure(self, phase: str) -> None:
        statuses = [s for s in (await self.rollout.status()).values() if isinstance(s, EngineStatus)]
        if statuses:
            self._memory[f"memory/rollout/rss_mb/{phase}"] = max(s.rss_bytes for s in statuses) / MB
            self._memory[f"memory/rollout/device_mb/{phase}"] = max(s.device_memory_bytes for s in statuses) / MB

    def metrics(self) -> dict[str, float]:
        """The memory measured since the last call."""
        memory, self._memory = self._memory, {}
        return memory
