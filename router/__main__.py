"""`python -m router {serve,launch,client,plan,certs} ...`: kept for existing scripts; the same as
`pdserve serve|launch|client|plan|certs ...` (cli.cluster)."""

from __future__ import annotations

import sys

from cli.cluster import main

if __name__ == "__main__":
    sys.exit(main())
