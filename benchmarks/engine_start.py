"""An engine's start at this checkout against an earlier commit, side by side on one machine.

    .venv/bin/python -m benchmarks.engine_start --commit REV [--runs 5] [--dtype float32]
        [--model default] [--threads 1] [--json PATH]

What every worker, tensor-parallel rank and offline `LLM` pays before its first step: importing
the engine, then building it (weights loaded and prepared for its GEMMs, the KV cache allocated).
The earlier commit is checked out into a temporary git worktree; each run is a fresh process
that imports the engine from its tree and times both parts, wall and CPU. One untimed run per
tree first (it builds the tree's native kernels and warms the page cache), then the trees take
turns (earlier, this, earlier, this, ...), so drift in the machine's speed hits both alike.
Ratios are median(this) / median(earlier); each pair's ratio is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import commit_tree, head_commit, tree_env, write_json

REPO = Path(__file__).resolve().parents[1]
PARTS = ("import_s", "build_s", "import_cpu_s", "build_cpu_s")
# Run in the tree's own directory (first on sys.path), so that an earlier tree's engine is the
# one imported: only `engine.llm.LLM(model, dtype=...)`, which every tree since the first has.
CHILD = """
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import torch
torch.set_num_threads(int(sys.argv[3]))
from engine.llm import LLM
t1, c1 = time.perf_counter(), time.process_time()
LLM(sys.argv[1], dtype=sys.argv[2])
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1,
                  "import_cpu_s": c1 - c0, "build_cpu_s": c2 - c1}))
"""


def start_once(tree: Path, model: str, dtype: str, threads: int,
               timeout: float) -> dict[str, float]:
    """One fresh process at `tree`: its import and build times."""
    done = subprocess.run([sys.executable, "-c", CHILD, model, dtype, str(threads)], cwd=tree,
                          env=tree_env(tree), check=True, capture_output=True, text=True,
                          timeout=timeout)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(commit: str, runs: int, model: str, dtype: str, threads: int,
            timeout: float) -> dict[str, Any]:
    starts: dict[str, list[dict[str, float]]] = {"earlier": [], "this": []}
    with commit_tree(commit) as base_tree:
        trees = (("earlier", base_tree), ("this", REPO))
        for _, tree in trees:
            start_once(tree, model, dtype, threads, timeout)  # kernels built, files cached
        for _ in range(runs):
            for name, tree in trees:
                start = start_once(tree, model, dtype, threads, timeout)
                starts[name].append(start)
                print(f"{name}: import {start['import_s']:.2f} s, build "
                      f"{start['build_s']:.2f} s", flush=True)
    return {"commit": commit, "head": head_commit(), "model": model, "dtype": dtype,
            "threads": threads, "starts": starts, **summarize(starts)}


def summarize(starts: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each part's median per tree, this tree's over the earlier's, and each pair's ratio."""
    def part(name: str, key: str) -> list[float]:
        if key == "total_s":
            return [s["import_s"] + s["build_s"] for s in starts[name]]
        return [s[key] for s in starts[name]]

    keys = (*PARTS, "total_s")
    medians = {name: {key: statistics.median(part(name, key)) for key in keys}
               for name in starts}
    ratios = {key: medians["this"][key] / medians["earlier"][key] for key in keys}
    pairs = {key: [t / e for t, e in zip(part("this", key), part("earlier", key))]
             for key in ("build_s", "total_s")}
    return {"median": medians, "ratio": ratios, "pair_ratios": pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--runs", type=int, default=5, help="timed starts per tree (>= 1)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (>= 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per start")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.threads < 1:
        parser.error(f"--runs and --threads must be >= 1, got {args.runs}, {args.threads}")
    report = compare(args.commit, args.runs, args.model, args.dtype, args.threads,
                     args.timeout)
    for key in ("import_s", "build_s", "total_s", "build_cpu_s"):
        print(f"{key}: {report['commit']} {report['median']['earlier'][key]:.3f}, "
              f"{report['head']} {report['median']['this'][key]:.3f}, "
              f"ratio {report['ratio'][key]:.3f}x")
    print("build pairs: " + ", ".join(f"{r:.2f}x" for r in report["pair_ratios"]["build_s"]))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
