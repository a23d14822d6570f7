"""An adapter that drives an SGLang server through its HTTP API (the server runs on its own).

HTTP: the stdlib (urllib) on a thread pool of rollout.max_num_seqs threads, one blocking call per
sample, so each sample is reported as soon as it finishes; every call has a timeout. Requests carry
an "rid" so a cancelled one is aborted on the server (/abort_request). RolloutEngine holds new
requests while paused or asleep; Pause and Sleep also tell the server (/pause_generation,
/release_memory_occupation).

The model directory (model.path) must be readable here too: its tokenizer renders chat prompts
and its config gives the limits requests are validated against.

Log-probs come from SGLang's output_token_logprobs; whether they are taken before or after
temperature and top-k/top-p depends on the server's settings, so compare them with the actor's
at top_p = 1, top_k off, temperature 1 unless the server is configured to match.

Weights: SGLang takes them from disk (/update_weights_from_disk) or over the actor's weight-sync group.
With rollout.engine sglang the actor opens its groups as torch.distributed groups built the way SGLang
builds its own (rlfabric.weight_sync.torch_group, gloo or nccl): JoinWeightSyncGroup has the server join
as our rank (/init_weights_update_group with rank_offset = that rank), and ReceiveWeights holds generation
(our gate closes, in-flight requests finish on the old weights, then /pause_generation), has the server
receive each bucket of the manifest (/update_weights_from_distributed with load_format flattened_bucket:
the actor packs dense buckets, SGLang's layout) while the actor broadcasts it, flushes the cache with the
last one, records the version and continues (/continue_generation). SGLang checks no CRC-32: the bytes are
trusted to the collective. A failed bucket leaves the server's weights partly updated: the replica leaves
the group (the coordinator rebuilds it and the next sync sends every weight again) and its version stays
the old one. load_weights of in-memory tensors is not possible over HTTP and answers UNIMPLEMENTED (so the
grpc transport cannot reach SGLang).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition, InvalidArgument, Unavailable, Unimplemented
from rlfabric.core.host import load_tokenizer, trust_remote_code
from rlfabric.rollout.engine import Generation, RolloutEngine
from rlfabric.rollout.types import EngineLimits, Finish, FinishedSample, SamplingSpec, row_seed
from rlfabric.weight_sync.manifest import Manifest, SyncGroup
from rlfabric.weight_sync.receiver import SLACK_S, WeightSwap

log = logging.getLogger("rlfabric.rollout.sglang")
_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}
CONTROL_TIMEOUT_S = 60.0


class SGLangEngine(RolloutEngine):
    name = "sglang"

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self.url = config.rollout.sglang_url.rstrip("/")
        self._pool = ThreadPoolExecutor(max_workers=config.rollout.max_num_seqs, thread_name_prefix="sglang-http")
        self._sync_group: SyncGroup | None = None  # the actor's group the server joined
        self._update_lock = asyncio.Lock()  # one weight update at a time
        self._asleep_tags: set[str] = set()  # what Sleep released and no WakeUp has restored yet

    # -- HTTP --------------------------------------------------------------------------------

    def _http(self, method: str, path: str, payload: dict | None, timeout_s: float) -> dict:
        """One call (worker thread): the JSON answer, or a domain error naming the endpoint."""
        body = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=body, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            if error.code == 400:
                raise InvalidArgument(f"sglang {path} rejected the request: {detail}") from None
            raise Unavailable(f"sglang {path} answered HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise Unavailable(f"sglang server {self.url} unreachable ({path}): {reason}") from None
        if not raw.strip():
            return {}
        try:
            answer = json.loads(raw)
        except ValueError:
            return {"text": raw.decode(errors="replace")}
        return answer if isinstance(answer, dict) else {"result": answer}

    async def call(self, path: str, payload: dict | None = None, method: str = "POST",
                   timeout_s: float = CONTROL_TIMEOUT_S) -> dict:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._http, method, path, payload, timeout_s)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        from transformers import AutoConfig

        if not self.model:
            raise ValueError("rollout: model.path is empty; the sglang adapter reads the tokenizer and config there")
        model_config = await asyncio.to_thread(AutoConfig.from_pretrained, self.model,
                                               trust_remote_code=trust_remote_code(self.config))
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model, trust_remote_code(self.config))
        eos = self.tokenizer.eos_token_id
        max_len = self.config.rollout.max_model_len or model_config.max_position_embeddings
        self.limits = EngineLimits(model_config.vocab_size, max_len, () if eos is None else (eos,))
        await self._wait_healthy(self.config.rollout.engine_start_timeout_s)
        with contextlib.suppress(Unavailable, ValueError, TypeError):
            self.weight_version = int((await self.call("/get_weight_version", method="GET")).get("weight_version") or 0)

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.call("/health_generate", method="GET", timeout_s=min(30.0, timeout_s))
                return
            except Unavailable as error:
                if time.monotonic() > deadline:
                    raise Unavailable(f"sglang server not healthy within {timeout_s:.0f} s: {error}") from None
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- generation ----------------------------------------------------------------------------

    def generate_payload(self, prompt: list[int], params: SamplingSpec, p: int, s: int, rid: str) -> dict:
        """The /generate body of one sample."""
        sampling = {
            "n": 1, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_new_tokens": params.max_tokens, "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": True,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = row_seed(params.seed, p, s)
        return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": params.logprobs, "rid": rid}

    async def _generate_row(self, generation: Generation, prompt_index: int, sample_index: int) -> FinishedSample:
        """One /generate call; cancelling it (the caller went away) aborts the request on the server."""
        version = self.weight_version
        params = generation.params
        rid = f"{generation.request_id}-{prompt_index}-{sample_index}"
        payload = self.generate_payload(generation.prompts[prompt_index], params, prompt_index, sample_index, rid)
        try:
            answer = await self.call("/generate", payload, timeout_s=self.config.rollout.request_timeout_s)
        except asyncio.CancelledError:
            asyncio.ensure_future(self._abort(rid))
            raise
        try:
            return self._sample(answer, params, prompt_index, sample_index, version)
        except (KeyError, TypeError, ValueError) as error:
            raise Unavailable(f"sglang /generate: unexpected answer: {type(error).__name__}: {error}") from None

    async def _abort(self, rid: str) -> None:
        with contextlib.suppress(Exception):
            await self.call("/abort_request", {"rid": rid}, timeout_s=10.0)

    def _sample(self, answer: dict, params: SamplingSpec, p: int, s: int, version: int) -> FinishedSample:
        meta = answer.get("meta_info", {})
        token_ids = [int(t) for t in answer["output_ids"]]
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []] if params.logprobs else []
        finish = meta.get("finish_reason") or {}
        reason = _FINISH.get(finish.get("type") if isinstance(finish, dict) else finish, Finish.ABORT)
        return FinishedSample(p, s, token_ids, logprobs, reason, version, answer.get("text", ""))

    # -- control -------------------------------------------------------------------------------

    async def _hold(self, abort: bool) -> None:
        if abort:
            await self.call("/pause_generation", {"mode": "abort"})
            await self._drain()
        else:  # our in-flight requests finish, then the server holds anything else in place
            await self._drain()
            await self.call("/pause_generation", {"mode": "in_place"})

    async def _release(self) -> None:
        await self.call("/continue_generation", {})

    async def _sleep(self, level: int) -> None:
        await self._drain()
        await self.call("/release_memory_occupation", {})
        self._asleep_tags = {"weights", "kv_cache"}

    async def _wake_up(self, tags: Sequence[str]) -> bool:
        """As vLLM's: weights first (a weight sync fills them), the KV cache after; generating again once
        both are back."""
        await self.call("/resume_memory_occupation", {"tags": list(tags)} if tags else {})
        self._asleep_tags -= set(tags) if tags else self._asleep_tags
        return not self._asleep_tags

    async def flush_cache(self) -> None:
        await self.call("/flush_cache", {})

    async def load_weights(self, weights: Iterable, version: int | None = None) -> int:
        raise Unimplemented("the sglang engine cannot take in-memory tensors over HTTP: use "
                            "update_weights_from_disk or the process-group transport")

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> int:
        """Loads a checkpoint directory the server can read; returns the new weight version."""
        version = self.weight_version + 1 if version is None else int(version)
        await self.call("/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)},
                        timeout_s=self.config.rollout.drain_timeout_s)
        await self.flush_cache()
        self.weight_version = version
        return version

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "nccl",
                                        timeout_s: float | None = None) -> None:
        """Has the server join the trainer's process group (the weight-sync transport)."""
        answer = await self.call("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }, timeout_s=timeout_s or self.config.rollout.drain_timeout_s)
        if answer.get("success") is False:
            raise Unavailable(f"sglang could not join weight-sync group {group_name}: {answer.get('message', '')}")

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], group_name: str,
                                              version: int | None = None) -> int:
        """The server receives one broadcast of these tensors; the trainer broadcasts meanwhile."""
        version = self.weight_version + 1 if version is None else int(version)
        await self.call("/update_weights_from_distributed", {
            "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, "flush_cache": True, "weight_version": str(version),
        }, timeout_s=self.config.rollout.drain_timeout_s)
        self.weight_version = version
        return version

    # -- weight sync: the server joins the actor's torch group ---------------------------------------

    async def join_weight_sync(self, group: SyncGroup, rank: int) -> None:
        """Has the server join the actor's group as `rank` (blocks until every rank has joined)."""
        group.check_rank(rank)
        if not group.torch_group:
            raise FailedPrecondition(f"weight-sync group {group.group_id} ({group.transport}) is not a torch group, "
                                     "the only kind an SGLang server can join: the actor opens one when its "
                                     "config says rollout.engine=sglang, over gloo or nccl (not grpc)")
        self._sync_group = None
        await self.init_weights_update_group(group.store_host, group.store_port, rank, group.world_size,
                                             group.group_id, "nccl" if group.transport == "nccl" else "gloo",
                                             timeout_s=group.timeout_s + SLACK_S)
        self._sync_group = group

    async def receive_weights(self, manifest: Manifest) -> WeightSwap:
        """The server receives the manifest's buckets from the actor's broadcast, with generation held."""
        group = self._sync_group
        if group is None:
            raise FailedPrecondition("this sglang replica has not joined a weight-sync group (JoinWeightSyncGroup)")
        if manifest.group_id != group.group_id:
            raise FailedPrecondition(f"manifest is for weight-sync group {manifest.group_id!r}, this replica "
                                     f"joined {group.group_id!r}")
        if manifest.adapter is not None:
            raise FailedPrecondition("the sglang engine takes full weights only (weight_sync.lora: merged)")
        limits = self.weight_limits()
        if limits is not None:
            limits.check(manifest)
        check_dense(manifest)
        async with self._update_lock:
            started = time.monotonic()
            held = not self._paused  # an engine paused by Pause stays paused after the update
            if held:
                await self.pause(abort=False)
            try:
                for bucket in manifest.buckets:
                    last = bucket.index == manifest.buckets[-1].index
                    await self._receive_bucket(group, bucket, manifest.version, flush_cache=last)
                self.weight_version = manifest.version
            except BaseException:
                self._sync_group = None  # its collective failed or was abandoned: the group is broken
                raise
            finally:
                if held:
                    await self.resume()
        swap = WeightSwap(self.weight_version, time.monotonic() - started)
        log.info("weights received", extra={"fields": {"version": swap.version, "bytes": manifest.num_bytes,
                                                       "paused_s": round(swap.paused_seconds, 4)}})
        return swap

    async def _receive_bucket(self, group: SyncGroup, bucket, version: int, flush_cache: bool) -> None:
        answer = await self.call("/update_weights_from_distributed", {
            "names": [t.name for t in bucket.tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for t in bucket.tensors],
            "shapes": [list(t.shape) for t in bucket.tensors], "group_name": group.group_id,
            "flush_cache": flush_cache, "weight_version": str(version), "load_format": "flattened_bucket",
        }, timeout_s=group.timeout_s + SLACK_S)
        if answer.get("success") is False:
            raise Unavailable(f"sglang could not load weight bucket {bucket.index}: {answer.get('message', '')}")

    async def leave_weight_sync(self) -> None:
        group, self._sync_group = self._sync_group, None
        if group is not None:
            with contextlib.suppress(Exception):
                await self.call("/destroy_weights_update_group", {"group_name": group.group_id}, timeout_s=10.0)
        await super().leave_weight_sync()


def check_dense(manifest: Manifest) -> None:
    """SGLang unpacks a bucket as its tensors back to back (its flattened bucket): a manifest with gaps
    (an actor that packed for another engine) is refused before the server allocates anything."""
    for bucket in manifest.buckets:
        end = 0
        for tensor in bucket.tensors:
            if tensor.offset != end:
                raise FailedPrecondition(f"weight bucket {bucket.index}: {tensor.name} starts at byte {tensor.offset}, "
                                         f"not {end}; SGLang takes dense buckets (the actor packs them when its "
                                         "config says rollout.engine=sglang)")
            end += tensor.num_bytes
        if bucket.num_bytes != end:
            raise FailedPrecondition(f"weight bucket {bucket.index} has {bucket.num_bytes} bytes, its tensors {end}")
