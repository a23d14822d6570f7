"""The subprocess runner with a warm host (agent.subprocess.preload): episodes forked from one process that
imported the agent's installed dependencies once (rlfabric.agents.forkserver), instead of an interpreter each.

    host = await WarmHost.start(entrypoint, working_dir)     # (runners.WarmProcessRunner: with its first episode)
    status, stdout, stderr = await host.run(request, task_json)   # confined as the cold path's process

Each episode's stdin, stdout and stderr are pipes made here and handed to the host (SCM_RIGHTS), so its output is
read as the cold path reads a process's; its exit status comes back as a message. A host that ends (killed, or
crashed) fails the episodes it was running, and the next episode starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import sys
from typing import Any

from rlfabric.agents.forkserver import MESSAGE_BYTES
from rlfabric.agents.outcome import EXITED, AgentFailed


class WarmHost:
    """One forkserver process and its control socket: episodes out, exit statuses back."""

    def __init__(self, process: asyncio.subprocess.Process, control: socket.socket):
        self.process = process
        self.control = control
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.alive = True
        self.episodes = 0
        self.cpu_s = 0.0  # the episodes' CPU seconds (launcher and agent), as the host reaped them
        asyncio.get_running_loop().add_reader(control.fileno(), self._on_message)

    @classmethod
    async def start(cls, entrypoint: str, working_dir: str | None) -> WarmHost:
        """The host for `entrypoint`, once it imported what it preloads; AgentFailed if it died first."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "rlfabric.agents.forkserver",
                entrypoint,
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                cwd=working_dir,
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        host = cls(process, ours)
        try:
            await host.ready
        except BaseException:
            await host.close()
            raise
        return host

    def _on_message(self) -> None:
        try:
            data = self.control.recv(MESSAGE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._lost()
            return
        message = json.loads(data)
        if "ready" in message:
            self.ready.set_result(message)
            return
        future = self.pending.pop(message["id"], None)
        self.episodes += 1
        self.cpu_s += message["cpu_s"]
        if future is not None and not future.done():
            future.set_result(message["status"])

    def _lost(self) -> None:
        asyncio.get_running_loop().remove_reader(self.control.fileno())
        self.alive = False
        failure = AgentFailed(EXITED, "the warm agent host exited")
        for future in [self.ready, *self.pending.values()]:
            if not future.done():
                future.set_exception(failure)
        self.pending.clear()

    async def _send(self, message: dict, fds: list[int] = ()) -> None:
        data = json.dumps(message).encode()
        while True:
            try:
                socket.send_fds(self.control, [data], list(fds))
                return
            except BlockingIOError:  # its buffer is full: wait until the host has read
                writable = asyncio.get_running_loop().create_future()
                asyncio.get_running_loop().add_writer(self.control.fileno(), writable.set_result, None)
                try:
                    await writable
                finally:
                    asyncio.get_running_loop().remove_writer(self.control.fileno())

    async def run(self, request: dict[str, Any], stdin: bytes) -> tuple[int, bytes, bytes]:
        """One episode: (its exit status, stdout, stderr). Cancelled, its launcher is killed first."""
        if not self.alive:
            raise AgentFailed(EXITED, "the warm agent host exited")
        number = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[number] = future
        (stdin_r, stdin_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
        try:
            await self._send({"op": "run", "id": number, **request}, [stdin_r, out_w, err_w])
        except BaseException:
            self.pending.pop(number, None)
            for fd in (stdin_w, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, out_w, err_w):
                os.close(fd)
        output = asyncio.gather(
            _read_all(out_r), _read_all(err_r), asyncio.to_thread(_write_all, stdin_w, stdin)
        )
        try:
            status = await future
            stdout, stderr, _ = await output
        except BaseException:
            if not future.done() and self.alive:
                with contextlib.suppress(OSError):
                    await self._send({"op": "kill", "id": number})
                with contextlib.suppress(BaseException):
                    await asyncio.shield(future)  # killed and reaped, as the cold path waits for its process
            output.cancel()
            with contextlib.suppress(BaseException):
                await output
            raise
        return status, stdout, stderr

    async def close(self) -> None:
        if self.alive:
            self._lost()
        self.control.close()
        with contextlib.suppress(ProcessLookupError):
            if self.process.returncode is None:
                await asyncio.wait_for(self.process.wait(), 10)


async def _read_all(fd: int) -> bytes:
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
    )
    try:
        return await reader.read()
    finally:
        transport.close()


def _write_all(fd: int, data: bytes) -> None:
    with open(fd, "wb", 0) as pipe, contextlib.suppress(BrokenPipeError):
        pipe.write(data)
