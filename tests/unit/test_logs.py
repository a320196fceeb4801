"""--log-format text|json and the worker's refusal line: one record, its structured fields
readable in both formats; a process killed by a signal leaves its Python stacks in its log."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from common.logs import JsonFormatter, TextFormatter, configure_logging
from serving.gate import Gate
from serving.loop import LoadSnapshot
from serving.metrics import WorkerMetrics


def record(message: str, **fields: object) -> logging.LogRecord:
    entry = logging.LogRecord("pdserve.access", logging.WARNING, __file__, 1, message, (), None)
    entry.fields = fields
    return entry


def test_text_and_json_lines_carry_the_fields():
    entry = record("request failed: too long", request_id="r1", status="INVALID_ARGUMENT",
                   ttft_s=0.25, cause="prompt is 2000000 characters")
    text = TextFormatter().format(entry)
    assert " WARNING pdserve.access request failed: too long request_id=r1 " in text
    assert "ttft_s=0.2500" in text and 'cause="prompt is 2000000 characters"' in text
    line = json.loads(JsonFormatter().format(entry))
    assert line["level"] == "warning" and line["logger"] == "pdserve.access"
    assert line["message"] == "request failed: too long" and line["request_id"] == "r1"
    assert line["ttft_s"] == 0.25 and line["ts"].endswith("Z")


def test_configure_logging_refuses_unknown_levels_and_formats():
    with pytest.raises(ValueError, match="--log-level must be one of"):
        configure_logging("loud", "text")
    with pytest.raises(ValueError, match="--log-format"):
        configure_logging("info", "xml")


class AbortingContext:
    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise RuntimeError(f"{code.name}: {message}")


def test_a_worker_logs_each_refusal_with_its_reason(caplog):
    gate = Gate("decode-0", WorkerMetrics("decode", LoadSnapshot), max_queued_requests=4)
    gate.draining.set()
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="UNAVAILABLE"):
        gate.check_new(AbortingContext(), "Reserve")
    [refusal] = caplog.records
    assert refusal.getMessage() == "refused Reserve: worker decode-0 is draining: it takes no " \
        "new requests"
    assert refusal.fields == {"worker_id": "decode-0", "method": "Reserve",
                              "status": "UNAVAILABLE"}


def test_a_process_killed_by_a_signal_leaves_its_python_stacks_in_its_log():
    script = ("import os, signal\n"
              "from common.logs import report_fatal_signals\n"
              "report_fatal_signals()\n"
              "os.kill(os.getpid(), signal.SIGSEGV)\n")
    root = Path(__file__).resolve().parents[2]
    died = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                          text=True, timeout=60)
    assert died.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in died.stderr
    assert "most recent call first" in died.stderr  # the stack of the thread that died
