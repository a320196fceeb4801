"""python -m prefill_worker --router HOST:PORT [--model PATH] [--threads N] ..."""

from __future__ import annotations

import sys

from common.logs import report_fatal_signals
from prefill_worker.role import prefill_role
from serving.worker_main import main

if __name__ == "__main__":
    report_fatal_signals()
    sys.exit(main("prefill", prefill_role))
