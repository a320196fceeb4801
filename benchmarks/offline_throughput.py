"""Offline throughput: ours vs transformers (static and continuous batching) vs the roofline.

    .venv/bin/python -m benchmarks.offline_throughput [--workload PATH] [--dtypes float32,bfloat16]
        [--runs 3] [--systems ours,hf_static,hf_cb] [--out SECTION.md] [--plot PNG]

Every system × dtype (and the matmul-peak measurement) runs in its own child process, one at a
time, each waited on with a timeout.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_WORKLOAD, load_workload
from benchmarks.report import markdown_table, plot, section, table_rows
from benchmarks.roofline import Shapes, workload_flops

REPO_ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("ours", "hf_static", "hf_cb")
DTYPES = ("float32", "bfloat16")


def _csv(value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(allowed)}, got "
                                         f"{value!r}")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--dtypes", type=lambda v: _csv(v, DTYPES), default=list(DTYPES))
    p.add_argument("--systems", type=lambda v: _csv(v, SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--runs", type=int, default=3, help="timed runs of ours (>= 1)")
    p.add_argument("--peer-runs", type=int, default=1, help="timed runs of each transformers peer")
    p.add_argument("--out", help="write the markdown section here (default: print only)")
    p.add_argument("--plot", default=str(REPO_ROOT / "benchmarks" / "offline_throughput.png"))
    p.add_argument("--json", help="also dump every child's raw result here")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--peak-m", default="1024,2048", help="row counts M of the peak matmuls")
    p.add_argument("--peak-repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.runs < 1 or args.peer_runs < 1:
        p.error("--runs and --peer-runs must be >= 1")
    return args


def run_child(system: str, dtype: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Run one child to completion (or kill it at the timeout) and read its JSON result."""
    import json

    result_path = workdir / f"{system}-{dtype}.json"
    log_path = workdir / f"{system}-{dtype}.log"
    runs = args.runs if system == "ours" else args.peer_runs
    cmd = [sys.executable, "-m", "benchmarks.child", system, dtype, "--result", str(result_path),
           "--workload", args.workload, "--runs", str(runs), "--timeout", str(args.timeout),
           "--peak-m", str(args.peak_m), "--peak-repeats", str(args.peak_repeats)]
    print(f"[offline_throughput] {system} {dtype} (log: {log_path})", file=sys.stderr, flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)
            return {"system": system, "dtype": dtype,
                    "error": f"timed out after {args.timeout:.0f}s"}
    if not result_path.is_file():
        tail = log_path.read_text()[-2000:]
        return {"system": system, "dtype": dtype,
                "error": f"exit {proc.returncode}, no result; log tail: {tail}"}
    return json.loads(result_path.read_text())


def run_all(args: argparse.Namespace, workdir: Path) -> tuple[list[dict], dict[str, dict]]:
    results: list[dict[str, Any]] = []
    peaks: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes:
        peaks[dtype] = run_child("roofline", dtype, args, workdir)
        for system in args.systems:
            results.append(run_child(system, dtype, args, workdir))
            _print_progress(results[-1])
    return results, peaks


def _print_progress(result: dict[str, Any]) -> None:
    what = result.get("error") or f"{result['tok_s_median']:.2f} tok/s"
    print(f"[offline_throughput]   -> {result['system']} {result['dtype']}: {what}",
          file=sys.stderr, flush=True)


def _model_shapes() -> Shapes:
    from engine.config import ModelConfig
    from engine.loader import resolve_model_path

    return Shapes.from_model_config(ModelConfig.from_dir(resolve_model_path("default")))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = load_workload(args.workload)
    flops = workload_flops(_model_shapes(), rows)
    workdir = Path(tempfile.mkdtemp(prefix="offline_throughput-"))
    results, peaks = run_all(args, workdir)
    failed = [r for r in [*results, *peaks.values()] if "error" in r]
    if failed:
        print(f"[offline_throughput] {len(failed)} child(ren) failed; logs kept in {workdir}",
              file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    command = " ".join([".venv/bin/python -m benchmarks.offline_throughput",
                        *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in rows)
    print(markdown_table(table_rows(results, peaks, flops)))
    text = section(results, peaks, flops, args.workload, len(rows), prompt_tokens, command)
    if args.out:
        Path(args.out).write_text(text)
        print(f"[offline_throughput] section written to {args.out}", file=sys.stderr)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({"results": results, "peaks": peaks,
                                               "flops": flops}, indent=1))
    if plot(results, args.plot):
        print(f"[offline_throughput] plot written to {args.plot}", file=sys.stderr)
    else:
        print("[offline_throughput] matplotlib missing: no plot", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
