"""`python -m router {serve,launch,client,plan,certs} ...`: kept for existing scripts; the same as
`pdserve serve|launch|client|plan|certs ...` (cli.cluster)."""

from __future__ import annotations

import sys

from cli.cluster import main
from common.logs import report_fatal_signals

if __name__ == "__main__":
    report_fatal_signals()
    sys.exit(main())
