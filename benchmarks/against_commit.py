"""Ours at this checkout against ours at an earlier commit, side by side on one machine.

    .venv/bin/python -m benchmarks.against_commit --commit REV [--runs 3] [--dtype float32]
        [--workload PATH] [--json PATH]

The earlier commit is checked out into a temporary git worktree. The two trees then take turns
(earlier, this, earlier, this, ...), each run a fresh child process (`benchmarks.child ours`, one
warm-up, one timed pass over the workload), so drift in the machine's speed hits both alike. The
ratio reported is median(this) / median(earlier). Both trees run with this checkout's virtualenv;
the child imports the engine from its own tree (its working directory comes first on sys.path).
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

from benchmarks.common import (
    DEFAULT_WORKLOAD,
    commit_tree,
    head_commit,
    tree_env,
    write_json,
)

REPO = Path(__file__).resolve().parents[1]


def _run_child(tree: Path, dtype: str, workload: str, timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run([sys.executable, "-m", "benchmarks.child", "ours", dtype,
                        "--workload", workload, "--runs", "1", "--result", result.name],
                       cwd=tree, env=tree_env(tree), check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL)
        data = json.loads(Path(result.name).read_text())
    if "error" in data:
        raise RuntimeError(f"ours at {tree} failed: {data['error']}")
    return data


def compare(commit: str, runs: int, dtype: str, workload: str, timeout: float) -> dict[str, Any]:
    tok_s: dict[str, list[float]] = {"earlier": [], "this": []}
    with commit_tree(commit) as base_tree:
        for _ in range(runs):
            for name, tree in (("earlier", base_tree), ("this", REPO)):
                result = _run_child(tree, dtype, workload, timeout)
                tok_s[name].append(result["tok_s_median"])
                print(f"{name}: {result['tok_s_median']:.2f} tok/s", flush=True)
    head = head_commit()
    medians = {name: statistics.median(values) for name, values in tok_s.items()}
    return {"commit": commit, "head": head, "dtype": dtype, "workload": workload,
            "tok_s": tok_s, "median": medians, "ratio": medians["this"] / medians["earlier"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--runs", type=int, default=3, help="child runs per tree (>= 1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per child")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    report = compare(args.commit, args.runs, args.dtype, args.workload, args.timeout)
    print(f"{args.dtype} tok/s, medians of {args.runs}: {report['commit']} "
          f"{report['median']['earlier']:.2f}, {report['head']} {report['median']['this']:.2f}, "
          f"ratio {report['ratio']:.3f}x")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
