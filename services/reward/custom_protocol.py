"""The custom reward worker's messages (rlfabric.reward.custom_worker): one JSON object per line, and the
supervisor's relay that passes the pool's items to the scorer and only checked replies back.

Protocol with the pool on stdin/stdout, one JSON object per line:
  pool -> worker, once:     settings (see CustomScorerPool._start_worker)
  worker -> pool, once:     {"type": "ready", "warnings": [...]} or {"type": "load_error", "message": ...}
  pool -> worker:           {"data_source", "solution_str", "ground_truth", "extra_info"}
  worker -> pool, per item: {"type": "result", "value": float | {str: float}}
                            or {"type": "error", "message": ..., "recycle": bool}
Scorer and supervisor speak the same messages, each item and reply carrying the item's "nonce".
What the user's function returns is turned into floats in the scorer and checked in the supervisor,
so the pool only ever parses JSON of numbers. A reply is taken only when the scorer's own pid sent it
(SO_PASSCRED), for the item being scored (its fresh random nonce), in the shape the protocol allows;
anything else fails the item and ends the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import socket
import struct
import time
from typing import Any

import psutil

from rlfabric.reward.items import short_message
from rlfabric.sandbox.confine import renew_cpu_limit
from rlfabric.sandbox.process_tree import MEMORY_CHECK_S, MemoryBound, kill_descendants, wait_for_children

# A reply longer than this without a newline is out of protocol (the supervisor holds it in memory).
MAX_REPLY_BYTES = 1 << 20
_UCRED = struct.Struct("iII")  # struct ucred of SCM_CREDENTIALS: pid, uid, gid

# The supervisor's view of its scorer.
_LOADING = "loading"
_IDLE = "idle"
_BUSY = "busy"  # scoring the item sent with `nonce`


class _OutOfProtocol(Exception):
    """What the scorer sent is not a reply the supervisor expects now."""


class Relay:
    """The supervisor's side of both protocols: items from the pool to the scorer, checked replies back."""

    def __init__(
        self, scorer: psutil.Process, channel: socket.socket, cpu_limit_s: int | None, bound: MemoryBound
    ):
        self.scorer = scorer
        self.channel = channel
        self.cpu_limit_s = cpu_limit_s
        self.bound = bound
        self.me = os.getpid()
        self.state = _LOADING
        self.nonce = ""
        self.from_pool = b""
        self.from_scorer = b""
        self.selector = selectors.DefaultSelector()
        self.next_memory_check = time.monotonic() + MEMORY_CHECK_S

    def run(self, scorer_exited_fd: int) -> None:
        """Relay until the scorer ends, the pool closes its pipe, the scorer breaks the protocol or the
        sandbox goes past its memory limit (checked every MEMORY_CHECK_S while user code runs)."""
        self.selector.register(0, selectors.EVENT_READ, self._on_pool)
        self.selector.register(self.channel, selectors.EVENT_READ, self._on_scorer)
        self.selector.register(scorer_exited_fd, selectors.EVENT_READ, None)
        try:
            while True:
                watch = self.state in (_LOADING, _BUSY) and self.bound.limit_mb
                timeout = max(0.0, self.next_memory_check - time.monotonic()) if watch else None
                for key, _ in self.selector.select(timeout):
                    if key.data is None:
                        self._scorer_ended()
                        return
                    if not key.data():
                        return
                if watch and time.monotonic() >= self.next_memory_check:
                    self.next_memory_check = time.monotonic() + MEMORY_CHECK_S
                    reason = self.bound.check(self.me)
                    if reason:
                        self._fail(reason)
                        return
        finally:
            self.selector.close()

    def _on_pool(self) -> bool:
        data = os.read(0, 1 << 16)
        if not data:
            return False  # the pool closed the pipe (or died)
        *lines, self.from_pool = (self.from_pool + data).split(b"\n")
        for line in lines:
            if self.state != _IDLE:
                return False  # the pool sends one item at a time, and only to a ready worker
            item = json.loads(line)
            self.nonce = item["nonce"] = secrets.token_hex(16)
            if self.cpu_limit_s:
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                    renew_cpu_limit(self.scorer, self.cpu_limit_s)
            self.state = _BUSY
            self.next_memory_check = time.monotonic() + MEMORY_CHECK_S
            with contextlib.suppress(OSError):  # the scorer is gone: the reaper says so next
                self.channel.sendall(encode_line(item))
        return True

    def _on_scorer(self) -> bool:
        try:
            data, ancdata, _, _ = self.channel.recvmsg(1 << 16, socket.CMSG_SPACE(_UCRED.size))
        except OSError:
            data = b""
        if not data:  # the scorer closed its end: it is ending, the reaper says when
            self.selector.unregister(self.channel)
            return True
        try:
            sender = _sender_pid(ancdata)
            if sender != self.scorer.pid:
                raise _OutOfProtocol(f"process {sender} wrote on the result channel, not the scorer")
            *lines, self.from_scorer = (self.from_scorer + data).split(b"\n")
            if len(self.from_scorer) > MAX_REPLY_BYTES:
                raise _OutOfProtocol(f"a reply longer than {MAX_REPLY_BYTES} bytes")
            for line in lines:
                ending = self.state
                message = self._checked(line)
                if message["type"] != "load_error":  # the load or an item has ended: so has all it started
                    reason = self._end_item(message.pop("ended", True))  # (the load: always)
                    if reason:
                        self.state = ending
                        return self._fail(reason)
                write_all(1, encode_line(message))
        except _OutOfProtocol as exc:
            return self._broken(str(exc))
        return True

    def _end_item(self, scorer_ended_some: bool) -> str:
        """Kill every process the item (or the load) started that the scorer left, and wait until they
        are reaped; the scan of the process table (milliseconds) only where the scorer says it had some
        to end (always after the load). Why the sandbox went past its memory limit, or ''.

        The scorer's word is the function's process's: its own code could make it lie, the processes it
        starts cannot (the scorer is not dumpable after its uid change: no ptrace, no /proc/PID/mem), and
        the cgroup's count of OOM kills is the kernel's."""
        if scorer_ended_some:
            kill_descendants(self.me, spare=self.scorer.pid)
            wait_for_children(self.me, keep=self.scorer.pid)  # orphans: the worker's _Reaper reaps them
        return self.bound.check(self.me) if self.bound.cgroup else ""

    def _scorer_ended(self) -> None:
        """The scorer died: where the memory bound killed it, say so rather than leave a bare crash."""
        if self.state in (_LOADING, _BUSY):
            reason = self.bound.check(self.me)
            if reason:
                self._fail(reason)

    def _checked(self, line: bytes) -> dict:
        """The message for the pool that a reply line of the scorer stands for."""
        try:
            reply = json.loads(line)
        except ValueError:
            raise _OutOfProtocol("a reply that is not JSON") from None
        kind = reply.get("type") if isinstance(reply, dict) else None
        if self.state == _LOADING and kind == "ready" and _strings(reply.get("warnings")):
            self.state = _IDLE
            warnings = reply["warnings"] + ([self.bound.warning] if self.bound.warning else [])
            return {"type": "ready", "warnings": warnings}
        if self.state == _LOADING and kind == "load_error" and isinstance(reply.get("message"), str):
            self.state = _IDLE  # it exits next: anything more is out of protocol
            return {"type": "load_error", "message": short_message(reply["message"])}
        if self.state != _BUSY:
            raise _OutOfProtocol(f"a {kind!r} reply while no item was being scored")
        if reply.get("nonce") != self.nonce:
            raise _OutOfProtocol("a reply without the item's nonce")
        if not isinstance(reply.get("ended"), bool):
            raise _OutOfProtocol(f"a {kind!r} reply without 'ended'")
        ended = reply["ended"]  # (for the supervisor's _end_item; never sent to the pool)
        if kind == "result" and _is_score(reply.get("value")):
            self.state = _IDLE
            return {"type": "result", "value": reply["value"], "ended": ended}
        if (
            kind == "error"
            and isinstance(reply.get("message"), str)
            and isinstance(reply.get("recycle"), bool)
        ):
            self.state = _IDLE
            message = short_message(reply["message"])
            return {"type": "error", "message": message, "recycle": reply["recycle"], "ended": ended}
        raise _OutOfProtocol(f"a malformed {kind!r} reply")

    def _broken(self, reason: str) -> bool:
        """Fail what the scorer was doing and stop relaying: nothing it sends is trusted any more."""
        return self._fail(f"the scorer broke the result protocol ({reason}); no score was taken from it")

    def _fail(self, message: str) -> bool:
        """Fail the item being scored (the pool replaces the worker) or the load, with `message`."""
        if self.state == _BUSY:
            write_all(1, encode_line({"type": "error", "message": message, "recycle": True}))
        elif self.state == _LOADING:
            write_all(1, encode_line({"type": "load_error", "message": message}))
        return False


def encode_line(message: dict) -> bytes:
    # json.dumps escapes newlines inside strings, so one message is one line.
    return json.dumps(message).encode() + b"\n"


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _sender_pid(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            return _UCRED.unpack_from(data)[0]
    return None


def _is_score(value: Any) -> bool:
    """A number, or a dict of numbers with a "score" (what custom_worker.to_plain makes); bools are not
    numbers here."""
    if isinstance(value, dict):
        return "score" in value and all(_is_number(item) for item in value.values())
    return _is_number(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)

