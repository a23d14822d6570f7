"""Waiting for a condition instead of sleeping a fixed time: a test goes on as soon as what it waits
for holds, and fails naming it when it never does.

    wait_until(lambda: port_file.exists(), 60, "the port file")
    await wait_until_async(lambda: all(r.healthy for r in router.replicas), 5, "every replica healthy")
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.02  # for conditions with no event to wait on: a process's state, a server's counters


def wait_until(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Calls `predicate` until it returns something truthy and returns that; AssertionError naming `what`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(POLL_S)
    return value


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], timeout: float, what: str) -> T:
    """wait_until inside an event loop: the loop keeps running between calls of `predicate`, which may
    be a coroutine function (e.g. a status RPC and a test of its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(POLL_S)
