"""python -m decode_worker --router HOST:PORT [--colocated] [--model PATH] ..."""

from __future__ import annotations

import sys

from common.logs import report_fatal_signals
from decode_worker.role import decode_role
from serving.worker_main import main

if __name__ == "__main__":
    report_fatal_signals()
    sys.exit(main("decode", decode_role))
