"""The services' JSON log lines (rlfabric.core.logs): a message, a field or a traceback that quotes a client's
huge input (issue 35: a 300-byte override once made 27 MiB of log) stays a few KiB and keeps its start and end."""

from __future__ import annotations

import json
import logging
import sys

from rlfabric.core.logs import _JsonLineFormatter


def test_a_log_line_quoting_a_huge_input_stays_small():
    try:
        raise ValueError("x" * (1 << 20) + " the end")
    except ValueError:
        record = logging.LogRecord("rlfabric.rpc", logging.ERROR, __file__, 1, "unexpected %s", ("y" * (1 << 20),),
                                   sys.exc_info())
    record.fields = {"error": "z" * (1 << 20), "count": 3}
    text = _JsonLineFormatter("coordinator", "run-1").format(record)
    assert len(text) < 128 << 10, len(text)
    line = json.loads(text)
    assert line["event"].startswith("unexpected yyy") and "characters cut" in line["event"]
    assert line["error"].startswith("zzz") and "characters cut" in line["error"]
    assert line["exception"].startswith("Traceback") and line["exception"].rstrip().endswith("the end")
    assert line["count"] == 3 and line["role"] == "coordinator"


def test_an_ordinary_line_is_left_whole():
    record = logging.LogRecord("rlfabric.rpc", logging.INFO, __file__, 1, "rpc failed", (), None)
    record.fields = {"method": "/rlfabric.v1.CoordinatorService/StartRun", "error": "trainer.total_steps: ..."}
    line = json.loads(_JsonLineFormatter("coordinator", "").format(record))
    assert line["event"] == "rpc failed" and line["error"] == "trainer.total_steps: ..."
