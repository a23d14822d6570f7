"""The hf engine's decode loop, in process: the host reads the sampled tokens once every steps_per_sync
steps, a row's tokens do not depend on that number nor on the rows that join its batch, rows of a request
that arrives mid-batch join it (continuous batching), joining never holds up a weight swap, and prompts that
begin alike prefill their common prefix once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rlfabric.rollout.hf_decode import DecodeBatch, shared_prefix
from rlfabric.rollout.hf_engine import HFEngine
from rlfabric.rollout.types import FinishedSample, SamplingSpec

from .helpers import original_weights, rollout_config

PROMPTS = [[1, 90, 88, 74], [1, 70, 88, 88, 78, 88, 89, 70, 83], [40, 41]]
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


@pytest.fixture(scope="module")
def engine(tiny_model):
    """One hf engine for the module, on an event loop in a thread of its own: its batches' thread, and the
    OpenMP threads torch starts on it (slow to start on a loaded machine), are started once."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    # float32 on a GPU too: a row's tokens are compared across batches, which bfloat16 kernels of other batch
    # sizes would round differently.
    engine = HFEngine(rollout_config(tiny_model, "rollout.dtype=float32"))
    engine.run = lambda coroutine, timeout=120: asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)
    engine.run(engine.start())
    engine.run(collect(engine, PROMPTS, max_tokens=4))  # torch's first ops on the batches' thread: slow under load
    yield engine
    engine.run(engine.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@contextlib.contextmanager
def changed(engine: HFEngine, eos: bool = True, forward_delay_s: float = 0.0, partial_rollouts: bool = True):
    """The engine for one test: eos=False, rows run to their max_tokens; forward_delay_s, each forward takes
    that much longer, so a batch stays in flight a while. Puts everything back after."""
    limits, steps, rollout = engine.limits, engine.steps_per_sync, engine.config.rollout
    if not eos:
        engine.limits = dataclasses.replace(limits, eos_token_ids=())
    if forward_delay_s:
        forward = engine.net.forward

        def slow(*args, **kwargs):
            time.sleep(forward_delay_s)
            return forward(*args, **kwargs)

        engine.net.forward = slow
    engine.config.rollout = rollout.model_copy(update={"partial_rollouts": partial_rollouts})
    try:
        yield engine
    finally:
        engine.limits, engine.steps_per_sync, engine.config.rollout = limits, steps, rollout
        vars(engine.net).pop("forward", None)


async def collect(engine: HFEngine, prompts, **params) -> list[FinishedSample]:
    spec = SamplingSpec(**{"temperature": 1.0, "seed": 0, **params})
    samples = [sample async for sample in engine.generate(prompts, spec)]
    return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))


async def until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.002)


async def start_long(engine: HFEngine, prompts, tokens: int, **params) -> asyncio.Task:
    """Starts collecting a request once the engine is idle (a request's last samples are delivered just before
    its batch ends), and waits until its rows have `tokens` tokens."""
    await until(lambda: not engine._running)
    task = asyncio.create_task(collect(engine, prompts, **params))
    await until(lambda: any(len(row.token_ids) >= tokens for row in list(engine._running)))
    return task


class HostReads(TorchFunctionMode):
    """Counts the reads of tensor values by the host (a sync with a GPU) outside the model's forward (the
    model's own forward is the same for transformers' generate) and the forwards."""

    def __init__(self):
        super().__init__()
        self.reads = self.forwards = 0
        self.in_forward = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.in_forward and getattr(func, "__name__", "") in HOST_READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))

    def watch(self, engine: HFEngine) -> None:
        """Counts in the engine's batches (the mode is per thread: it is entered on the batch's thread)."""
        run_batch, forward = engine._run_batch, engine.net.forward

        def counted_batch(*args):
            with self:
                return run_batch(*args)

        def counted_forward(*args, **kwargs):
            self.forwards += 1
            self.in_forward = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.in_forward = False

        engine._run_batch, engine.net.forward = counted_batch, counted_forward


def test_the_host_reads_the_tokens_once_every_steps_per_sync(engine):
    counts = {}
    with changed(engine, eos=False):
        for steps in (1, 8):
            engine.steps_per_sync = steps
            reads = HostReads()
            reads.watch(engine)
            try:
                samples = engine.run(collect(engine, PROMPTS, n=4, max_tokens=16))
            finally:
                del engine._run_batch, engine.net.forward
            assert [len(s.token_ids) for s in samples] == [16] * 12
            counts[steps] = (reads.reads, reads.forwards)
    # A prefill and 15 forwards; the tokens and their log-probs read once per read (16 or 2 reads).
    assert counts == {1: (2 * 16, 16), 8: (2 * 2, 16)}


def test_a_rows_tokens_do_not_depend_on_the_steps_per_read(engine):
    """Rows that end mid-read (EOS, a stop id, a stop string) end at the same token whatever the number of
    steps between reads: the tokens sampled past their end are dropped."""
    runs = {}
    reference = sorted(engine.run(collect(engine, PROMPTS, n=3, max_tokens=24)), key=lambda s: -len(s.token_ids))
    stop_id = reference[0].token_ids[4]  # ends the longest sample at its 5th token at the latest
    stop_text = next(text for token in reference[1].token_ids[5:] if (text := engine.decode([token]).strip()))
    with changed(engine):
        for steps in (1, 8):
            engine.steps_per_sync = steps
            runs[steps] = (engine.run(collect(engine, PROMPTS, n=3, max_tokens=24, stop_token_ids=(stop_id,)))
                           + engine.run(collect(engine, PROMPTS, n=3, max_tokens=24, stop=(stop_text,))))
    every_step, every_8 = runs[1], runs[8]
    assert {s.finish_reason.value for s in every_step} == {"stop", "length"}
    assert any(len(s.token_ids) % 8 for s in every_step if s.finish_reason.value == "stop")  # mid-read
    assert [(s.token_ids, s.finish_reason, s.text) for s in every_8] == [
        (s.token_ids, s.finish_reason, s.text) for s in every_step]
    for mine, theirs in zip(every_8, every_step, strict=True):
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs))


def test_rows_that_arrive_mid_batch_join_it_and_keep_their_samples(engine):
    """A request that arrives while a long batch runs is decoded with it (it finishes long before the batch
    does) and both get the samples they get alone."""

    async def scenario():
        long_params, short_params = {"n": 2, "max_tokens": 80, "seed": 3}, {"n": 2, "max_tokens": 6, "seed": 4}
        long_alone = await collect(engine, PROMPTS[:1], **long_params)
        short_alone = await collect(engine, PROMPTS[1:], **short_params)
        long_run = await start_long(engine, PROMPTS[:1], 5, **long_params)
        short = await collect(engine, PROMPTS[1:], **short_params)
        assert not long_run.done(), "the short request waited for the long batch to end"
        assert [s.token_ids for s in short] == [s.token_ids for s in short_alone]
        assert [s.token_ids for s in await long_run] == [s.token_ids for s in long_alone]

    with changed(engine, eos=False, forward_delay_s=0.004):
        engine.run(scenario())


def test_no_row_joins_a_batch_that_a_weight_swap_waits_for(engine, tiny_model):
    """Without partial rollouts a swap waits for the running batch: rows that arrive meanwhile wait for the
    swap (they are generated under the new weights), or a stream of requests would hold the swap forever."""
    weights = list(original_weights(tiny_model).items())

    async def scenario():
        long_run = await start_long(engine, PROMPTS[:1], 5, n=2, max_tokens=60)
        swap = asyncio.create_task(engine.load_weights(weights, version=7))
        await until(lambda: engine._swap_waiting)
        late = await collect(engine, PROMPTS[1:], n=2, max_tokens=4)
        assert swap.done() and await swap == 7
        assert {s.weight_version for s in await long_run} == {before}
        assert {s.weight_version for s in late} == {7}

    before = engine.weight_version
    with changed(engine, eos=False, forward_delay_s=0.004, partial_rollouts=False):
        engine.run(scenario())


def test_shared_prefix_leaves_each_prompt_a_token_of_its_own():
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # one prompt is the other's start
    assert shared_prefix([[1, 2], [1, 2]]) == 1
    assert shared_prefix([[1, 2, 3]]) == 0  # alone: nothing to share
    assert shared_prefix([[7, 2], [1, 2]]) == 0


def test_prompts_that_begin_alike_prefill_their_common_prefix_once(engine):
    """The common prefix runs once (one forward of 1 row, then the rests), and every row's next-token logits
    are those of its prompt prefilled on its own."""
    prefix = [1, 90, 88, 74, 70, 88, 88, 78]
    prompts = [prefix + [40, 41], prefix + [89, 70, 83], prefix + [88]]
    spec = SamplingSpec(temperature=0.0)
    shapes = []
    forward = engine.net.forward

    def watched(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    def prefilled(batch_prompts, share):
        return DecodeBatch.prefill(engine.net, batch_prompts, list(range(len(batch_prompts))),
                                   [spec] * len(batch_prompts), [0] * len(batch_prompts), 0, share_prefix=share)

    with torch.inference_mode():
        engine.net.forward = watched
        try:
            shared = prefilled(prompts, True)
        finally:
            del engine.net.forward
        alone = torch.cat([prefilled([prompt], True).logits for prompt in prompts])
        unshared = prefilled(prompts, False)
    assert shapes == [(1, len(prefix)), (3, 3)]
    torch.testing.assert_close(shared.logits, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.logits, unshared.logits, atol=1e-5, rtol=1e-5)
    # The padding sits between the prefix and the rest: a row's positions count its real tokens only.
    assert shared.mask.tolist() == [[1] * 8 + [0] + [1] * 2, [1] * 11, [1] * 8 + [0, 0, 1]]
    assert shared.next_pos.tolist() == [len(p) for p in prompts]
    # Greedy decoding from there gives the same tokens as each prompt alone, through the engine.
    together = engine.run(collect(engine, prompts, temperature=0.0, max_tokens=8))
    separately = [engine.run(collect(engine, [prompt], temperature=0.0, max_tokens=8))[0] for prompt in prompts]
    assert [s.token_ids for s in together] == [s.token_ids for s in separately]
