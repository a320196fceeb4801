"""How every process logs: `--log-level` and `--log-format text|json` on the router and the
workers. A record may carry structured fields (`extra={"fields": {...}}`): the text format
appends them as key=value, the JSON format (one object per line, for log shippers) as keys."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import sys
import time
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text: one readable line per record; json: one JSON object per "
                             "line, structured fields as keys")


def logging_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The same flags, for the processes a launcher starts."""
    return ("--log-level", args.log_level, "--log-format", args.log_format)


def check_logging(level: str, log_format: str) -> None:
    """ValueError naming the flags when either value is not one they take."""
    if level not in LOG_LEVELS or log_format not in LOG_FORMATS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)} and --log-format "
                         f"one of {', '.join(LOG_FORMATS)}, got {level!r} and {log_format!r}")


def configure_logging(level: str = "info", log_format: str = "text") -> None:
    check_logging(level, log_format)
    handler = CurrentStderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, CurrentStderrHandler)]:
        root.removeHandler(old)  # ours from an earlier call; others' handlers stay
    root.addHandler(handler)
    root.setLevel(level.upper())


def report_fatal_signals() -> None:
    """A process that dies of a signal (a segfault or an abort in native code: torch, gloo,
    gRPC) writes every thread's Python stack to its stderr, its log, first; otherwise it ends
    with no line saying where. Called by the router's and the workers' `__main__`."""
    faulthandler.enable(file=sys.stderr, all_threads=True)


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (a test runner swaps it per test;
    a handler holding the old one would write to a closed file)."""

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        pairs = " ".join(f"{key}={_text(value)}" for key, value in fields_of(record).items())
        return f"{line} {pairs}" if pairs else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage(), **fields_of(record)}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    text = str(value)
    return json.dumps(text) if (not text or " " in text or "=" in text) else text
