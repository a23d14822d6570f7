"""The Ray launcher places an N-node x 8-GPU layout on a simulated Ray cluster (bench/ray_scale_bench.py) and runs it.

Four raylets here, not the issue's 32: a raylet with its two agents adds ~230 MB and takes ~6 s to start on this
machine, and a service process with its Ray worker ~130 MB, so a 32-node run needs about 12 GB of a machine shared
with other work (`make bench BENCH=ray_scale` reserves the 32-node placement and runs 8 nodes; docs/scaling.md).
About 2 min here. The layout's shape is the 32-node one: the actor's pool on one node, the reference's on another, the rollout's pool
over the rest, 8 simulated replicas of one GPU a node. Placement is checked per node, by Ray's word (the placement
group table, the node each service's actor reports and the GPU ids Ray assigned it) against the pools: no node's
GPUs reserved or held twice, each replica asking for a GPU of its own, not a share of one.
"""

from __future__ import annotations

import pytest

from bench import ray_scale_bench as bench

pytestmark = pytest.mark.slow

NODES = 4


def test_the_pools_land_as_configured_and_a_sim_run_completes_on_them(tiny_model):
    """One cluster for both (its start is most of the time): the run's own placement groups are checked as the
    bench's placement phase checks its reservation, and every service's node and GPU ids besides."""
    report = bench.sim_run(NODES, str(tiny_model))
    assert report["violations"] == []
    assert report["pools"] == {"train": 1, "ref": 1, "infer": NODES - 2}
    assert report["replicas"] == (NODES - 2) * bench.GPUS_PER_NODE
    assert report["completed"], report["error"]
    assert report["steps"] == [1, 2]
    assert report["simulated"] == [1.0, 1.0]  # the run's metrics say it was simulated
    assert report["delivered_samples"] == [report["samples_per_step"]] * 2  # every replica's samples, once
    # One process per trainer, per rollout node (its 8 replicas), the reward and the coordinator.
    assert report["service_processes"] == 2 + (NODES - 2) + 2
