"""A generative judge's pool started by the local launcher (the judge section, issue 48 item 2) and a training run
that scores every sample with it, whose judge is killed at a step boundary and restarted, then killed mid-call.

The policy is the quickstart's tiny model, on its find-the-vowel task. The judge is the same warm-started tiny
model with its output rows remapped (judge_model): asked "any letter of: <response>" it copies the letter, as its
warm start taught it, but writes a vowel as "1" and a consonant as "0", which the judge's regex reads as the
score: the task's own reward, from a real rollout service process (judge-0, an hf engine) that the launcher
starts before the reward service, whose config names it. One run of 10 steps, with algorithm.max_failed_fraction 1
(the judge scores every item, so while it is down every sample fails, and the run must go on):

- before the kill: every sample's score is the judge's own verdict for it (the same conversation asked of judge-0
  directly), and weight syncs reach the policy's replica, never the judge;
- once step 2's metrics arrive (the step-done event) the run is paused at its step boundary, judge-0 killed and the
  run resumed: every step after that until the restart fails each sample with the judge's failure (status error,
  UNAVAILABLE), masked (no gradient: actor/grad_norm 0 while the scored steps' is not) and counted
  (reward/judge_failures, rlfabric_reward_judge_failures_total);
- once the next step's metrics arrive the run is paused again, judge-0 restarted on its port and the run resumed:
  the steps after it are scored by the judge again;
- a step later the run is paused once more, judge-0's engine paused (it takes requests and holds them) and the
  run resumed; once the engine holds the reward service's Generate request of the next step (GetStatus
  queue_depth), judge-0 is killed with that call in flight: its items fail (UNAVAILABLE, not the deadline),
  masked and counted, the step ends well within reward.judge.timeout_s, and the run completes its 10 steps with the
  judge down, failing and counting every item.

The restart happens on this test's main thread with no RPC in flight (a fork while another thread is inside gRPC
can crash the child), so the run is followed in phases with the run paused between them; a kill forks nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import JudgeConfig
from rlfabric.launch.local import LocalMesh
from rlfabric.reward import find_vowel
from rlfabric.reward.client import RewardClient
from rlfabric.reward.items import STATUS_ERROR, ScoreItem
from rlfabric.reward.judge import JudgeClient, JudgeFailure, JudgeScorer, parse_score
from rlfabric.rollout.client import RolloutClient
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config
from tests.judges import VOWEL_JUDGE, judge_model
from tests.waiting import wait_until_async

pytestmark = pytest.mark.slow

STEPS, KILL_AFTER = 10, 2
ITEMS = 8 * 4  # a step's samples: data.train_batch_size 8 x rollout.n 4 (tests.coordinator.meshes.FAST)


def judge_run_config(judge_dir: Path):
    return fast_config(
        "",
        f"trainer.total_steps={STEPS}",
        f"judge.model_path={judge_dir}",
        *VOWEL_JUDGE,
        "reward.judge.batch_size=16",
        "reward.judge.timeout_s=60",
        "algorithm.max_failed_fraction=1.0",
    )


class Follower:
    """Follows the mesh's run over its metrics stream (the step-done events), in phases that each end with the
    run paused at a step boundary."""

    def __init__(self, mesh: LocalMesh):
        self.mesh = mesh
        self.options = ChannelOptions.from_config(mesh.config)
        self.metrics: dict[int, dict[str, float]] = {}

    def client(self) -> CoordinatorClient:
        return CoordinatorClient(self.mesh.endpoints["coordinator"][0]["grpc"], self.options)

    async def until_paused_after(self, step: int, start: bool = False) -> int:
        """(Starts or resumes the run,) follows it until `step` is done, pauses it; the last step done."""
        async with self.client() as client:
            await (client.start_run() if start else client.resume_run())
            async for update in client.stream_metrics(
                from_step=max(self.metrics, default=0) + 1, timeout_s=300
            ):
                self.metrics[update.step] = dict(update.metrics)
                if update.step >= step:
                    break
            await client.pause_run()
            status = await wait_until_async(
                lambda: paused(client), 120, "the run paused at its step boundary"
            )
            async for update in client.stream_metrics(from_step=max(self.metrics) + 1, timeout_s=5):
                self.metrics[update.step] = dict(
                    update.metrics
                )  # a step that ended while the pause was asked
                if update.step >= status.step:
                    break
            return status.step

    async def kill_the_judge_mid_call(self, judge: subprocess.Popen) -> tuple[int, float]:
        """Pauses judge-0's engine, resumes the run and kills judge-0 once its engine holds a Generate request of
        the next step (the reward service's call in flight); follows the run until that step is done. Returns
        the step and the seconds from the kill to its metrics."""
        step = max(self.metrics) + 1
        address = self.mesh.endpoints["judge"][0]["grpc"]
        async with self.client() as client, RolloutClient(address, self.options) as replica:
            await replica.pause()
            await client.resume_run()
            await wait_until_async(
                lambda: holding(replica), 120, "the judge's engine holding the reward service's request"
            )
            judge.kill()
            judge.wait()
            killed = time.monotonic()
            async for update in client.stream_metrics(from_step=step, timeout_s=300):
                self.metrics[update.step] = dict(update.metrics)
                if update.step >= step:
                    return step, time.monotonic() - killed
        raise AssertionError(f"step {step} never ended")

    async def to_the_end(self):
        async with self.client() as client:
            await client.resume_run()
            async for update in client.stream_metrics(from_step=max(self.metrics) + 1, timeout_s=300):
                self.metrics[update.step] = dict(update.metrics)
            return await client.run_status()

    async def weight_versions(self) -> dict[str, int]:
        versions = {}
        for role in ("rollout", "judge"):
            async with RolloutClient(self.mesh.endpoints[role][0]["grpc"], self.options) as replica:
                versions[role] = (await replica.status()).weight_version
        return versions


async def holding(replica: RolloutClient) -> bool:
    return (await replica.status()).queue_depth > 0


async def paused(client: CoordinatorClient):
    status = await client.run_status()
    return status if status.state == coordinator_pb2.RUN_STATE_PAUSED else None


def rollouts(mesh: LocalMesh, step: int) -> list[dict]:
    lines = (mesh.run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def judge_failures_total(mesh: LocalMesh, reason: str) -> float:
    """rlfabric_reward_judge_failures_total{reason} as the reward service's metrics endpoint reports it."""
    text = (
        urllib.request.urlopen(f"http://{mesh.endpoints['reward'][0]['metrics']}/metrics", timeout=10)
        .read()
        .decode()
    )
    match = re.search(
        rf'^rlfabric_reward_judge_failures_total\{{reason="{reason}"\}} (\S+)$', text, re.MULTILINE
    )
    return float(match.group(1)) if match else 0.0


async def judge_scores_through_the_reward_service(mesh: LocalMesh) -> None:
    """Waits until the reward service scores a vowel answer 1 through its judge (its channel to a restarted judge
    reconnects within client backoff)."""
    item = ScoreItem(find_vowel.DATA_SOURCE, "E", "E", prompt=find_vowel.INSTRUCTION + "B E C D F G")

    async def scored(reward: RewardClient) -> bool:
        result = (await reward.score([item]))[0]
        return result.ok and result.score == 1.0

    async with RewardClient(
        mesh.endpoints["reward"][0]["grpc"], ChannelOptions.from_config(mesh.config)
    ) as reward:
        await wait_until_async(
            lambda: scored(reward), 60, "the reward service scoring through the restarted judge"
        )


async def direct_scores(mesh: LocalMesh, records: list[dict]) -> list[float | None]:
    """Each dumped sample's score as judge-0 gives it asked directly (None: its verdict does not parse)."""
    config: JudgeConfig = mesh.config.reward.judge
    scorer = JudgeScorer(config)  # only for its conversation(): the reward service's own rendering
    conversations = [
        scorer.conversation(ScoreItem(r["data_source"], r["response"], r["ground_truth"], prompt=r["prompt"]))
        for r in records
    ]
    async with JudgeClient(
        mesh.endpoints["judge"][0]["grpc"], ChannelOptions.from_config(mesh.config)
    ) as judge:
        verdicts = await judge.verdicts(conversations, config, timeout_s=300)
    scores: list[float | None] = []
    for verdict in verdicts:
        try:
            scores.append(parse_score(verdict, config))
        except JudgeFailure:
            scores.append(None)
    return scores


def test_the_launcher_starts_the_judge_pool_and_a_killed_judge_fails_masks_and_counts_its_items(tmp_path):
    with LocalMesh(judge_run_config(judge_model(tmp_path / "judge")), tmp_path / "run") as mesh:
        judge_address = mesh.endpoints["judge"][0]["grpc"]
        assert mesh.config.reward.judge.addresses == [judge_address]  # the reward's config names the pool
        assert judge_address not in mesh.config.cluster.rollout
        run = Follower(mesh)
        killed_after = asyncio.run(run.until_paused_after(KILL_AFTER, start=True))
        versions = asyncio.run(run.weight_versions())
        judge = next(p for p in mesh.processes if p.name == "judge-0")
        judge.process.kill()
        judge.process.wait()
        restarted_after = asyncio.run(run.until_paused_after(killed_after + 1))
        unavailable = judge_failures_total(mesh, "unavailable")  # the items of the steps while it was down
        mesh.restart("judge-0")  # on the port it had: the reward service's config still names it
        asyncio.run(judge_scores_through_the_reward_service(mesh))
        judged_until = asyncio.run(run.until_paused_after(restarted_after + 1))
        judged = [*range(1, killed_after + 1), *range(restarted_after + 1, judged_until + 1)]
        # The judged steps' samples asked of judge-0 directly while it is up (the same greedy verdicts).
        direct = {step: asyncio.run(direct_scores(mesh, rollouts(mesh, step))) for step in judged}
        judge = next(p for p in mesh.processes if p.name == "judge-0")
        killed_in, kill_to_step_end_s = asyncio.run(run.kill_the_judge_mid_call(judge.process))
        status = asyncio.run(run.to_the_end())
        unavailable_at_end = judge_failures_total(mesh, "unavailable")
        metrics = run.metrics

        print(
            f"judge killed after step {killed_after}, restarted after step {restarted_after}, killed mid-call in "
            f"step {killed_in} (its end {kill_to_step_end_s:.2f} s after the kill); items failed unavailable: "
            f"{unavailable:g}, at the end {unavailable_at_end:g}; judge failures per step:",
            json.dumps({step: metrics[step].get("reward/judge_failures/count") for step in sorted(metrics)}),
            "; grad_norm per step:",
            json.dumps({step: round(metrics[step]["actor/grad_norm"], 4) for step in sorted(metrics)}),
        )
        # The run went on through the judge's death and completed its steps.
        assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status
        assert sorted(metrics) == list(range(1, STEPS + 1))
        assert restarted_after < judged_until < killed_in == judged_until + 1 <= STEPS, (
            restarted_after,
            judged_until,
            killed_in,
        )
        # Weight syncs reached the policy's replica, never the judge.
        assert versions["rollout"] > 0 and versions["judge"] == 0

        # Before the kill: every sample's score is the judge's (asked again after the restart: the same verdict).
        for step in range(1, killed_after + 1):
            records, expected = rollouts(mesh, step), direct[step]
            assert [None if r["score_failed"] else r["score"] for r in records] == expected, step
            assert metrics[step]["reward/judge_failures/count"] == expected.count(None)
            assert metrics[step]["actor/grad_norm"] > 0
        assert {0.0, 1.0} <= set(expected), expected  # the judge told vowels from consonants

        # Every step begun while the judge was down: each item failed with the judge's failure, masked and counted.
        for step in range(killed_after + 1, restarted_after + 1):
            down = metrics[step]
            assert (
                down["reward/judge_failures/fraction"] == 1.0 and down["reward/score_failed/fraction"] == 1.0
            )
            assert down["actor/grad_norm"] == 0.0, step  # no gradient from the masked samples
            for record in rollouts(mesh, step):
                assert record["score_failed"] and record["failure"]["status"] == STATUS_ERROR
                assert (
                    "judge: " in record["failure"]["message"]
                    and "UNAVAILABLE" in record["failure"]["message"]
                )
        assert unavailable == ITEMS * (restarted_after - killed_after)

        # Restarted: the judge scores every later step again, until it is killed mid-call.
        for step in range(restarted_after + 1, judged_until + 1):
            records, expected = rollouts(mesh, step), direct[step]
            assert [None if r["score_failed"] else r["score"] for r in records] == expected, step
            assert metrics[step]["reward/judge_failures/count"] == expected.count(None) < ITEMS
            assert metrics[step]["actor/grad_norm"] > 0

        # Killed with the reward service's call in flight: that step's items and every later step's fail with the
        # judge's failure (the broken call's, not its deadline's), masked and counted; no step waits for the
        # deadline, and the run completed its steps with the judge down.
        assert kill_to_step_end_s < mesh.config.reward.judge.timeout_s
        for step in range(killed_in, STEPS + 1):
            down = metrics[step]
            assert down["reward/judge_failures/count"] == ITEMS, step
            assert down["actor/grad_norm"] == 0.0, step
            for record in rollouts(mesh, step):
                assert record["score_failed"] and record["failure"]["status"] == STATUS_ERROR
                assert "UNAVAILABLE" in record["failure"]["message"], record["failure"]
        assert unavailable_at_end == unavailable + ITEMS * (STEPS - killed_in + 1)
