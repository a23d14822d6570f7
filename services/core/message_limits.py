"""How large a request each RPC may be, and what a refused large request leaves behind.

A method that carries a batch, prompts, responses to score or weights (BULK_METHODS) takes requests up
to server.max_receive_message_mb; every other one (a Step, a status, a path, a run's overrides) up to
server.max_control_message_kb. Two places refuse a bigger request with RESOURCE_EXHAUSTED:

- gRPC itself, per server (grpc.max_receive_message_length is one number per server): a role none of
  whose methods is a bulk one (env, coordinator) gets the control limit there, and gRPC refuses a bigger
  request from its length prefix, before it buffers a byte of it;
- the ErrorInterceptor's deserializer, per method: a control method of a role that also serves bulk
  ones refuses a bigger request by its length before protobuf parses it (gRPC has buffered it by then).

Memory a refused request used is freed, but glibc keeps freed heap pages mapped for reuse: four refused
100 MiB requests left a bare grpc.aio server 130-190 MiB larger. After a failed RPC whose request was
RELEASE_BYTES or more, the process returns free heap pages to the kernel (malloc_trim) once the RPC ends.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import logging
import platform
from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf import descriptor_pool

log = logging.getLogger("rlfabric.server")

BULK_METHODS = frozenset({
    "/rlfabric.v1.ActorService/ComputeLogProbs",
    "/rlfabric.v1.ActorService/UpdatePolicy",
    "/rlfabric.v1.ActorService/UpdatePolicyStream",  # per message: a piece of ~4 MiB of rows
    "/rlfabric.v1.CriticService/ComputeValues",
    "/rlfabric.v1.CriticService/UpdateValues",
    "/rlfabric.v1.ReferenceService/ComputeLogProbs",
    "/rlfabric.v1.ReferenceService/ReceiveWeights",  # a manifest: one entry per tensor of the model
    "/rlfabric.v1.RewardService/Score",
    "/rlfabric.v1.RolloutService/Generate",
    "/rlfabric.v1.RolloutService/GenerateStream",
    "/rlfabric.v1.RolloutService/ReceiveWeights",
    "/rlfabric.v1.RolloutService/PushWeights",
})
# A failed request this large has its freed memory returned to the kernel. Smaller ones are left to
# glibc's own trimming: their memory is what the next requests reuse.
RELEASE_BYTES = 16 << 20


@dataclass(frozen=True)
class MessageLimits:
    """The largest request, in bytes, of a bulk method and of any other."""

    bulk_bytes: int
    control_bytes: int

    def of(self, method: str) -> int:
        """The limit of `method` ("/package.Service/Method")."""
        return self.bulk_bytes if method in BULK_METHODS else min(self.control_bytes, self.bulk_bytes)

    def of_server(self, services: Iterable[str]) -> int:
        """What gRPC may let through on a server of `services` (full names): its largest method limit."""
        pool = descriptor_pool.Default()
        limits = [self.of(f"/{service}/{method.name}") for service in services
                  for method in _methods(pool, service)]
        return max(limits, default=self.of(""))


def _methods(pool, service: str):
    try:
        return pool.FindServiceByName(service).methods
    except KeyError:  # not an rlfabric.v1 service (health, reflection): control methods
        return ()


# -- returning a refused request's memory -----------------------------------------------------------

_request_bytes: contextvars.ContextVar[int] = contextvars.ContextVar("rlfabric_request_bytes", default=0)
_release_pending = False


def note_request_size(num_bytes: int) -> None:
    """Called by the deserializer, in the RPC's own task: the size of the request it received."""
    if num_bytes >= RELEASE_BYTES:
        _request_bytes.set(num_bytes)


def release_after_failure() -> None:
    """From a failing RPC's task: when its request was large, return free heap memory to the kernel once
    the task (and with it every reference to the request) is gone. One release at a time."""
    global _release_pending
    if _request_bytes.get() < RELEASE_BYTES or _release_pending or _malloc_trim is None:
        return
    task = asyncio.current_task()
    if task is None:
        return
    _release_pending = True
    task.add_done_callback(_release)


def _release(task: asyncio.Task) -> None:
    def trim() -> None:
        global _release_pending
        try:
            _malloc_trim(0)
        finally:
            _release_pending = False

    task.get_loop().run_in_executor(None, trim)


def _load_malloc_trim():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()
