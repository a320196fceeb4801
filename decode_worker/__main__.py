"""python -m decode_worker --router HOST:PORT [--colocated] [--model PATH] ..."""

from __future__ import annotations

import logging
import sys

from decode_worker.role import DecodeRole
from serving.options import parse_worker_args
from serving.worker_main import build_engine, serve


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    options = parse_worker_args("decode", argv)
    engine = build_engine(options)
    return serve(options, DecodeRole(engine, options), engine.model_path.name)


if __name__ == "__main__":
    sys.exit(main())
