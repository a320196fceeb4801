"""One benchmark child process: `python -m benchmarks.child SYSTEM DTYPE --result PATH ...`.

Each system × dtype runs in its own process so its peak RSS is its own; the parent runs them one
at a time so they never share the CPU.
"""

from __future__ import annotations

import argparse
import time
import traceback
from typing import Any

from benchmarks.common import load_workload, loadavg_1m, peak_rss_mb, write_json

SYSTEMS = ("ours", "hf_static", "hf_cb", "roofline")


def _model_dir() -> str:
    from engine.loader import resolve_model_path

    return str(resolve_model_path("default"))


def run_system(args: argparse.Namespace) -> dict[str, Any]:
    rows = load_workload(args.workload)
    if args.system == "ours":
        from benchmarks.ours import run_ours

        return run_ours(rows, args.dtype, args.runs)
    if args.system == "hf_static":
        from benchmarks.peers import run_hf_static

        return run_hf_static(rows, args.dtype, args.runs, _model_dir())
    if args.system == "hf_cb":
        from benchmarks.peers import run_hf_cb

        return run_hf_cb(rows, args.dtype, args.runs, _model_dir(), args.timeout)
    from benchmarks.roofline import Shapes, measure_peak
    from engine.config import ModelConfig

    shapes = Shapes.from_model_config(ModelConfig.from_dir(_model_dir()))
    return measure_peak(shapes, args.dtype, ms=tuple(int(m) for m in args.peak_m.split(",")),
                        repeats=args.peak_repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("system", choices=SYSTEMS)
    parser.add_argument("dtype", choices=("float32", "bfloat16"))
    parser.add_argument("--result", required=True, help="JSON file to write")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0, help="hf_cb collection timeout")
    parser.add_argument("--peak-m", default="1024,2048", help="comma list of row counts M")
    parser.add_argument("--peak-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    load_start, wall_start = loadavg_1m(), time.perf_counter()
    try:
        result = run_system(args)
    except Exception as exc:  # reported in the table, not fatal to the other systems
        traceback.print_exc()
        result = {"system": args.system, "dtype": args.dtype,
                  "error": f"{type(exc).__name__}: {exc}"}
    result.update({"loadavg_start": load_start, "loadavg_end": loadavg_1m(),
                   "child_wall_s": time.perf_counter() - wall_start,
                   "peak_rss_mb": peak_rss_mb()})
    write_json(args.result, result)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
