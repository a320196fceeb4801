"""The served path at this checkout against an earlier commit, side by side on one machine.

    .venv/bin/python -m benchmarks.served_against_commit --commit REV [--rounds 3]
        [--runs 2] [--concurrency 16] [--dtype bfloat16] [--api grpc] [--json OUT]

Each round runs `benchmarks.served_thread_cpu` (a colocated cluster, N gRPC streams at once,
each process's CPU split per streamed token) once in the earlier tree and once in this one, in
that order, each in a fresh child process with its own cluster, so drift in the machine's speed
hits both alike. The earlier commit is checked out into a temporary git worktree and must have
that benchmark (with `--api`, unless it is grpc). Reported per tree: medians over every run of
every round of ITL p50 and of the CPU each part spends per streamed token, and their ratios
(this / earlier).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import commit_tree, tree_env, write_json
from benchmarks.kv_transfer import cpu_model
from benchmarks.served_thread_cpu import API_NAMES

REPO = Path(__file__).resolve().parents[1]
PARTS = ("worker_messaging_s", "router_s", "client_s")


def _one_tree(tree: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    api = [] if args.api == "grpc" else ["--api", args.api]  # older trees know only gRPC
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "benchmarks.served_thread_cpu",
                        "--runs", str(args.runs), "--concurrency", str(args.concurrency),
                        "--dtype", args.dtype, "--threads", str(args.threads), *api,
                        "--json", out.name], cwd=tree, env=tree_env(tree), check=True,
                       timeout=args.timeout,
                       stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over runs: ITL p50 (ms) and each part's CPU per streamed token (µs)."""
    out = {"itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in runs),
           "wall_s": statistics.median(r["wall_s"] for r in runs)}
    for part in PARTS:
        out[part.removesuffix("_s") + "_us_per_token"] = statistics.median(
            r[part] / r["tokens"] * 1e6 for r in runs)
    return out


def compare(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"earlier": [], "this": []}
    with commit_tree(args.commit) as base:
        for round_ in range(args.rounds):
            for name, tree in (("earlier", base), ("this", REPO)):
                got = _one_tree(tree, args)
                runs[name] += got
                print(f"round {round_ + 1} {name}: ITL p50 "
                      f"{[round(r['itl_p50_ms'], 1) for r in got]} ms", flush=True)
    medians = {name: summary(values) for name, values in runs.items()}
    ratios = {key: medians["this"][key] / medians["earlier"][key] for key in medians["this"]}
    return {"commit": args.commit, "machine": cpu_model(), "dtype": args.dtype,
            "api": args.api, "concurrency": args.concurrency, "runs": runs, "median": medians,
            "ratio": ratios}


def table(report: dict[str, Any]) -> list[str]:
    api = API_NAMES[report.get("api", "grpc")]
    lines = [f"Machine: {report['machine']}; {report['dtype']}; {report['concurrency']} {api} "
             f"streams; medians over {len(report['runs']['this'])} runs per tree.", "",
             "| tree | ITL p50 ms | worker messaging µs/token | router µs/token | "
             "client µs/token |", "|---|---|---|---|---|"]
    for name, label in (("earlier", report["commit"]), ("this", "this checkout")):
        m = report["median"][name]
        lines.append(f"| {label} | {m['itl_p50_ms']:.1f} | "
                     f"{m['worker_messaging_us_per_token']:.0f} | "
                     f"{m['router_us_per_token']:.0f} | {m['client_us_per_token']:.0f} |")
    r = report["ratio"]
    lines.append(f"| this / earlier | {r['itl_p50_ms']:.3f} | "
                 f"{r['worker_messaging_us_per_token']:.3f} | {r['router_us_per_token']:.3f} | "
                 f"{r['client_us_per_token']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=2, help="timed runs per cluster (after a warm-up)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per child")
    p.add_argument("--api", default="grpc", choices=sorted(API_NAMES))
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args(argv)
    for name in ("rounds", "runs", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    report = compare(args)
    print("\n".join(table(report)))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
