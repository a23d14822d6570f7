"""The simulated trainer (<role>.engine sim): requests validated as the torch engine validates them, updates in the
time 6 x parameters x tokens FLOPs take at the modelled GPUs, the run's metrics marked simulated, and checkpoints
that round-trip its counters."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlfabric.core.config import load_config
from rlfabric.core.errors import InvalidArgument
from rlfabric.sim.trainer_cost import TrainerCost
from rlfabric.trainer.sim_engine import LOG_PROB, SimTrainerEngine

# 1e9 parameters on one GPU of 100 TFLOP/s at 50%: 6e9 x tokens / 5e13 s, i.e. 0.12 ms a token, at time scale 1.
MODEL = ["actor.engine=sim", "critic.engine=sim", "sim.trainer.parameters=1000000000", "sim.trainer.gpus=1",
         "sim.trainer.gpu_tflops=100", "sim.trainer.mfu=0.5", "actor.ppo_mini_batch_size=2", "rollout.n=2"]
LATE = 0.25  # a timer fires late by the loop's scheduling lag only: < a quarter of a >= 0.2 s prediction
CLOCK = 0.002


def batch(rows: int = 4, prompt: int = 300, response: int = 200, floats: tuple[str, ...] = ("advantages",)):
    length = prompt + response
    input_ids = torch.randint(0, 100, (rows, length))
    tensors = {"input_ids": input_ids, "attention_mask": torch.ones(rows, length, dtype=torch.int64),
               "responses": input_ids[:, prompt:].clone(), "response_mask": torch.ones(rows, response, dtype=torch.int64)}
    return {**tensors, **{name: torch.zeros(rows, response) for name in floats}}


@pytest.fixture
def storage(tmp_path):
    return [f"storage.root={tmp_path}"]


def test_an_update_takes_the_modelled_time_and_says_it_was_simulated(storage):
    config = load_config(None, [*MODEL, *storage])
    engine = SimTrainerEngine("actor", config)

    async def scenario():
        await engine.start()
        began = time.monotonic()
        metrics = await engine.update(batch(rows=8))
        return metrics, time.monotonic() - began

    metrics, seconds = asyncio.run(scenario())
    predicted = TrainerCost.of(config).update_seconds(8 * 500)
    assert predicted == pytest.approx(6e9 * 4000 / 5e13) and predicted > 0.2
    assert predicted - CLOCK <= seconds <= predicted * (1 + LATE)
    assert metrics["sim/simulated"] == 1.0 and metrics["sim/actor/update_modelled_s"] == pytest.approx(predicted)
    assert metrics["sim/actor/tokens"] == 4000 and "actor/grad_norm" in metrics
    assert engine.status().optimizer_step == 2  # 8 rows in mini-batches of 2 prompts x 2 samples


def test_log_probs_and_values_are_placeholders_of_the_batch_shape(storage):
    config = load_config(None, [*MODEL, *storage, "sim.time_scale=0.001"])

    async def scenario():
        actor, critic = SimTrainerEngine("actor", config), SimTrainerEngine("critic", config)
        await actor.start()
        await critic.start()
        return (await actor.compute(batch(floats=()), with_entropy=True),
                await critic.compute(batch(floats=())))

    policy, values = asyncio.run(scenario())
    assert policy["log_probs"].shape == (4, 200) and bool((policy["log_probs"] == LOG_PROB).all())
    assert policy["entropy"].shape == (4, 200) and values["values"].shape == (4, 200)


def test_bad_batches_are_refused_as_the_torch_engine_refuses_them(storage):
    config = load_config(None, [*MODEL, *storage, "sim.time_scale=0.001"])

    async def scenario():
        engine = SimTrainerEngine("actor", config)
        await engine.start()
        missing = batch(floats=())
        with pytest.raises(InvalidArgument, match="advantages"):
            await engine.update(missing)
        flat = batch()
        flat["input_ids"] = flat["input_ids"].flatten()
        with pytest.raises(InvalidArgument, match="2-D"):
            await engine.compute(flat)
        with pytest.raises(InvalidArgument, match="multiple of the mini-batch"):
            await engine.update(batch(rows=6))

    asyncio.run(scenario())


def test_a_checkpoint_restores_the_counters(storage, tmp_path):
    config = load_config(None, [*MODEL, *storage, "sim.time_scale=0.001"])

    async def scenario():
        engine = SimTrainerEngine("actor", config)
        await engine.start()
        await engine.update(batch(rows=8))
        written = await engine.save_checkpoint(str(tmp_path / "global_step_1" / "actor"))
        fresh = SimTrainerEngine("actor", config)
        await fresh.start()
        step = await fresh.load_checkpoint(str(tmp_path / "global_step_1" / "actor"))
        exported = await engine.export_hf(str(tmp_path / "final_model"))
        return written, step, fresh.worker.updates, exported

    written, step, updates, exported = asyncio.run(scenario())
    assert written > 0 and exported > 0 and (step, updates) == (2, 1)
    assert (tmp_path / "final_model" / "simulated.json").is_file()
