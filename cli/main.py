"""`pdserve`: one command for everything the project runs, in the habit of `vllm serve`.

  pdserve launch|serve|client|plan|certs|drain  the cluster: a local cluster, the router alone,
                                                a streaming client, the P:D planner, throwaway
                                                certificates, draining a worker (its running
                                                requests move) (`python -m router ...`)
  pdserve prefill ... | pdserve decode ...      one worker (`python -m prefill_worker` or
                                                `python -m decode_worker`)
  pdserve deploy up|status|down ...             the cluster on Ray (`python -m deploy`)
  pdserve loadtest run|local ...                Locust against a cluster (`python -m loadtest`)
  pdserve bench NAME ...                        a benchmark, from a checkout
                                                (`python -m benchmarks.NAME`)
  pdserve generate|prepare-model|build-kernels  the offline engine (`python -m engine`)

`pdserve COMMAND --help` shows a command's options. Every `python -m` form keeps working.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

CLUSTER = ("launch", "serve", "client", "plan", "certs", "drain")
ENGINE = ("generate", "prepare-model", "build-kernels")


def _cluster(argv: list[str]) -> int:
    from cli.cluster import main

    return main(argv)


def _worker(role: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from serving.worker_main import main

        module = importlib.import_module(f"{role}_worker.role")
        return main(role, getattr(module, f"{role}_role"), argv)

    return run


def _module_main(module: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        return importlib.import_module(module).main(argv)

    return run


def _bench(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: pdserve bench NAME [options]  (a module of benchmarks/, e.g. "
              "offline_throughput, tokenize_stall, decode_kernel)", file=sys.stderr)
        return 2
    name = f"benchmarks.{argv[0]}"
    if Path("benchmarks", "__init__.py").is_file() and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a console script does not look in the checkout
    if importlib.util.find_spec("benchmarks") is None:
        print("pdserve bench runs the benchmarks of a checkout (run it from the repository)",
              file=sys.stderr)
        return 2
    sys.argv = [name, *argv[1:]]
    runpy.run_module(name, run_name="__main__", alter_sys=True)
    return 0


def commands() -> dict[str, Callable[[list[str]], int]]:
    table: dict[str, Callable[[list[str]], int]] = {}
    for name in CLUSTER:
        table[name] = lambda argv, name=name: _cluster([name, *argv])
    for name in ENGINE:
        table[name] = lambda argv, name=name: _module_main("engine.cli")([name, *argv])
    table.update(prefill=_worker("prefill"), decode=_worker("decode"),
                 deploy=_module_main("deploy.__main__"),
                 loadtest=_module_main("loadtest.__main__"), bench=_bench)
    return table


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    table = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command = table.get(argv[0])
    if command is None:
        print(f"pdserve: unknown command {argv[0]!r}; commands: {', '.join(table)}",
              file=sys.stderr)
        return 2
    return command(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
