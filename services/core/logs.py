"""Structured logging: one JSON object per line, with the role and run id in every line."""

from __future__ import annotations

import json
import logging
import sys
import time

# Longest text of one log field, and of a traceback (kept whole but for a huge message in it).
MAX_FIELD_CHARS = 16384
MAX_EXCEPTION_CHARS = 65536


class _JsonLineFormatter(logging.Formatter):
    def __init__(self, role: str, run_id: str):
        super().__init__()
        self.role = role
        self.run_id = run_id

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "role": self.role,
            "run_id": self.run_id,
            "logger": record.name,
            "event": _capped(record.getMessage()),
        }
        line.update({key: _capped(value) if isinstance(value, str) else value
                     for key, value in getattr(record, "fields", {}).items()})
        if record.exc_info:
            line["exception"] = _capped(self.formatException(record.exc_info), MAX_EXCEPTION_CHARS)
        return json.dumps(line, default=str)


def _capped(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """text, or its start and end around a note of what was cut: a message quoting a client's huge input
    must not become megabytes of log."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} characters cut ...] {text[-half:]}"


def setup_logging(role: str, run_id: str = "", level: str = "INFO") -> None:
    """Routes every logger to stderr as JSON lines tagged with role and run_id."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLineFormatter(role, run_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields) -> None:
    """Logs `event` with extra key/value fields that land as top-level JSON keys."""
    logger.log(level, event, extra={"fields": fields})
