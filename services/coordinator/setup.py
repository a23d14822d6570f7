"""Builds a run from its config: tokenizer, datasets, connections, weight sync and metric sinks.

The connections come from a `connect` function (config -> peers and weight sync): connect_services
for services over gRPC (config.cluster's addresses), rlfabric.launch.inprocess.InProcessMesh.connect for
engines in this process. Everything else is built the same way for both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from rlfabric.actor.models import check_policy_model
from rlfabric.coordinator.data_prep import write_arithmetic, write_lookup, write_synthetic
from rlfabric.coordinator.dataset import DatasetError, RLHFDataset
from rlfabric.coordinator.loop import PPOTrainer
from rlfabric.coordinator.peers import Peers
from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.config import RunConfig, run_dir_of
from rlfabric.core.errors import FailedPrecondition, InvalidArgument
from rlfabric.rollout.engine import load_tokenizer


def load_datasets(config: RunConfig, run_dir: Path, tokenizer) -> tuple[RLHFDataset, RLHFDataset | None]:
    """data.train_files / val_files, or data.builtin_task written into RUN_DIR/data."""
    data = config.data
    train_files, val_files = list(data.train_files), list(data.val_files)
    if not train_files:
        write = {"arithmetic": write_arithmetic, "lookup": write_lookup}.get(data.builtin_task, write_synthetic)
        paths = write(run_dir / "data" / data.builtin_task)
        train_files, val_files = [str(paths["train"])], val_files or [str(paths["val"])]
    try:
        kwargs = dict(tokenizer=tokenizer, max_prompt_length=data.max_prompt_length, truncation=data.truncation,
                      filter_overlong_prompts=data.filter_overlong_prompts)
        train = RLHFDataset(train_files, **kwargs)
        val = RLHFDataset(val_files, **kwargs) if val_files else None
    except DatasetError as error:
        raise InvalidArgument(str(error)) from None
    if data.train_batch_size > len(train):
        raise InvalidArgument(f"data.train_batch_size {data.train_batch_size} > {len(train)} usable training rows")
    return train, val


async def connect_services(config: RunConfig) -> tuple[Peers, WeightSyncPlane]:
    """Clients of the services in config.cluster (all of them ready) and the weight-sync plane over them, its
    transport chosen from the devices the actor and the replicas report."""
    peers = Peers.connect(config)
    try:
        await peers.wait_until_ready(config.client.connect_timeout_s)
        plane = WeightSyncPlane(peers.actor, {address: address for address in peers.rollout_addresses}, config)
        await plane.choose_transport()  # from the devices they hold; a forced nccl they cannot run fails here
    except BaseException:
        await peers.close()
        raise
    return peers, plane


# config -> (peers, weight sync): a WeightSyncPlane, or what the loop uses of one (open, sync, close,
# receivers, stale), e.g. rlfabric.launch.inprocess.LocalWeightSync.
Connect = Callable[[RunConfig], Awaitable[tuple[Peers, WeightSyncPlane]]]


async def build_trainer(config: RunConfig, between_steps, on_phase, on_metrics,
                        connect: Connect = connect_services) -> PPOTrainer:
    """A PPOTrainer for one run, connected to its services by `connect` (default: over gRPC, to
    config.cluster's addresses)."""
    if not config.model.path:
        raise FailedPrecondition("model.path is empty: the coordinator needs the policy's tokenizer")
    try:
        check_policy_model(config.model.path, config.model.trust_remote_code)
    except ValueError as error:
        raise FailedPrecondition(str(error)) from None
    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
    train, val = load_datasets(config, run_dir, tokenizer)
    peers, plane = await connect(config)
    return PPOTrainer(config, peers, tokenizer, run_dir, train, val, plane, on_phase=on_phase,
                      on_metrics=on_metrics, between_steps=between_steps)
