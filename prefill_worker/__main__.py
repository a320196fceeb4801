"""python -m prefill_worker --router HOST:PORT [--model PATH] [--threads N] ..."""

from __future__ import annotations

import logging
import sys

from prefill_worker.role import PrefillRole
from serving.options import parse_worker_args
from serving.worker_main import build_engine, serve


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    options = parse_worker_args("prefill", argv)
    engine = build_engine(options)
    return serve(options, PrefillRole(engine, options), engine.model_path.name)


if __name__ == "__main__":
    sys.exit(main())
