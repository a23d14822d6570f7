"""Catch-up from a peer (weight_sync.delta over the grpc transport): a rollout replica that joined the weight-sync
group reaches the version its peers hold from one of them, not from the actor, before the next sync, so that sync
is a delta to every member and the actor's egress does not grow with the joiners.

    report.catchup_from_peer, report.catchup_from_actor = await catch_up(members, held, version, timeout_s, buckets)

A peer that holds `version` (its delta base, rlfabric.weight_sync.delta.DeltaBase) pushes it along the joiners as a
relay chain (RolloutService.PushHeldWeights, rlfabric.weight_sync.chain.push_held); every bucket carries the actor's
CRC-32, checked as it lands, so a caught-up joiner holds the actor's bytes exactly. Joiners a peer did not reach are
tried from the next peer; those no peer reaches keep no base, and the sync gives them (and, a delta needing every
member's base, everyone) the actor's full weights: catchup_from_actor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from rlfabric.rollout.client import RolloutInterface
from rlfabric.weight_sync.push_metadata import HOP_SLACK_S
from rlfabric.weight_sync.receiver import SLACK_S

log = logging.getLogger("rlfabric.coordinator.catchup")


async def catch_up(members: Mapping[str, tuple[str, RolloutInterface]], held: dict[str, int], version: int,
                   hop_timeout_s: float, buckets: int) -> tuple[int, int, float]:
    """Members {name: (address, client)} whose `held` version is not `version` get it from a member that holds it;
    `held` records those that did. `buckets`: the full weights' bucket count (the push's deadline is per bucket).
    (joiners caught up by a peer, joiners left to the actor, seconds)."""
    started = time.perf_counter()
    joiners = [name for name in members if held.get(name) != version]
    caught = 0
    for donor in [name for name in members if held.get(name) == version]:
        if not joiners:
            break
        address, client = members[donor]
        deadline = hop_timeout_s * (max(1, buckets) + 1) + HOP_SLACK_S * len(joiners) + SLACK_S
        try:
            results, _ = await client.push_held_weights([members[j][0] for j in joiners], version, hop_timeout_s,
                                                        timeout_s=deadline)
        except Exception as error:  # that peer cannot (restarted, a rejected delta cleared its base): the next one
            log.warning("catch-up from rollout %s failed: %s", donor, error)
            continue
        by_address = {result.address: result for result in results}
        for name in list(joiners):
            result = by_address.get(members[name][0])
            if result is not None and not result.error and result.version == version:
                held[name] = version
                joiners.remove(name)
                caught += 1
            else:
                log.warning("catch-up of rollout %s from %s failed: %s", name, donor,
                            result.error if result is not None else "the peer reported nothing for it")
    if caught or joiners:
        log.info("rollout replicas caught up", extra={"fields": {
            "version": version, "from_peer": caught, "from_actor": joiners}})
    return caught, len(joiners), time.perf_counter() - started
