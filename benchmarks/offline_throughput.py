"""Offline throughput: ours vs transformers (static and continuous batching), vLLM's CPU backend
(opt-in) and the roofline.

    .venv/bin/python -m benchmarks.offline_throughput [--workload PATH] [--dtypes float32,bfloat16]
        [--runs 3] [--rounds 1] [--systems ours,hf_static,hf_cb,vllm_cpu] [--out SECTION.md]
        [--plot PNG]

Every system × dtype (and the matmul-peak measurement) runs in its own child process, one at a
time, each waited on with a timeout (a timed-out child is killed with everything it started).
With `--rounds R` the systems take turns: R rounds of one child per system, so a host that
speeds up or slows down during the invocation (10-20% seen between invocations on these VMs)
weighs on every system alike; a system's figure is the median of its runs over all rounds.
vllm_cpu runs under .venv-vllm's python: `bash benchmarks/vllm_cpu_setup.sh` first.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_WORKLOAD, load_workload
from benchmarks.report import markdown_table, plot, section, table_rows
from benchmarks.roofline import Shapes, workload_flops
from benchmarks.vllm_env import DEFAULT_KV_CACHE_GIB, VllmNotInstalled, vllm_env, vllm_python

REPO_ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("ours", "hf_static", "hf_cb", "vllm_cpu")
DEFAULT_SYSTEMS = ("ours", "hf_static", "hf_cb")  # vllm_cpu needs its own venv: opt-in
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
    p.add_argument("--systems", type=lambda v: _csv(v, SYSTEMS), default=list(DEFAULT_SYSTEMS))
    p.add_argument("--runs", type=int, default=3, help="timed runs of ours and vllm_cpu (>= 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="children per system, taking turns with the other systems (>= 1)")
    p.add_argument("--peer-runs", type=int, default=1, help="timed runs of each transformers peer")
    p.add_argument("--out", help="write the markdown section here (default: print only)")
    p.add_argument("--plot", default=str(REPO_ROOT / "benchmarks" / "offline_throughput.png"))
    p.add_argument("--json", help="also dump every child's raw result here")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--peak-m", default="1024,2048", help="row counts M of the peak matmuls")
    p.add_argument("--peak-repeats", type=int, default=5)
    p.add_argument("--vllm-kv-cache-gib", type=int, default=DEFAULT_KV_CACHE_GIB,
                   help="vllm_cpu's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.peer_runs < 1 or args.rounds < 1:
        p.error("--runs, --rounds and --peer-runs must be >= 1")
    if "vllm_cpu" in args.systems:
        try:  # before hours of other children, not after
            vllm_python()
        except VllmNotInstalled as exc:
            p.error(str(exc))
    return args


def child_command(system: str, dtype: str, args: argparse.Namespace, result_path: Path
                  ) -> tuple[list[str], dict[str, str] | None]:
    """The child's command line and environment (None: inherit ours)."""
    if system == "vllm_cpu":
        from engine.loader import resolve_model_path

        # -I: see benchmarks/vllm_child.py. Paths absolute: nothing of .venv is importable there.
        cmd = [str(vllm_python()), "-I", str(REPO_ROOT / "benchmarks" / "vllm_child.py"),
               str(resolve_model_path("default")), dtype, "--result", str(result_path),
               "--workload", str(Path(args.workload).resolve()), "--runs", str(args.runs)]
        return cmd, vllm_env(kv_cache_gib=args.vllm_kv_cache_gib, rpc_dir=result_path.parent)
    runs = args.runs if system == "ours" else args.peer_runs
    cmd = [sys.executable, "-m", "benchmarks.child", system, dtype, "--result", str(result_path),
           "--workload", args.workload, "--runs", str(runs), "--timeout", str(args.timeout),
           "--peak-m", str(args.peak_m), "--peak-repeats", str(args.peak_repeats)]
    return cmd, None


def run_child(system: str, dtype: str, args: argparse.Namespace, workdir: Path,
              round_no: int = 0) -> dict[str, Any]:
    """Run one child to completion (or kill it at the timeout) and read its JSON result."""
    import json

    name = f"{system}-{dtype}" + (f"-round{round_no}" if round_no else "")
    result_path = workdir / f"{name}.json"
    log_path = workdir / f"{name}.log"
    cmd, env = child_command(system, dtype, args, result_path)
    print(f"[offline_throughput] {system} {dtype} (log: {log_path})", file=sys.stderr, flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            return {"system": system, "dtype": dtype,
                    "error": f"timed out after {args.timeout:.0f}s"}
    if not result_path.is_file():
        tail = log_path.read_text()[-2000:]
        return {"system": system, "dtype": dtype,
                "error": f"exit {proc.returncode}, no result; log tail: {tail}"}
    return json.loads(result_path.read_text())


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc/*/stat (this kernel has no
    /proc/PID/task/TID/children): vLLM's engine core is a child of its child."""
    by_parent: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        by_parent.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = by_parent.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a timed-out child and everything it started (listed first: once the child is gone
    they are re-parented and no longer found under it), then reap the child."""
    below = descendants(proc.pid)
    proc.kill()
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def run_all(args: argparse.Namespace, workdir: Path) -> tuple[list[dict], dict[str, dict]]:
    results: list[dict[str, Any]] = []
    peaks: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes:
        peaks[dtype] = run_child("roofline", dtype, args, workdir)
        rounds: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
        for round_no in range(1, args.rounds + 1):
            for system in args.systems:
                rounds[system].append(run_child(system, dtype, args, workdir,
                                                round_no if args.rounds > 1 else 0))
                _print_progress(rounds[system][-1])
        results.extend(merge_rounds(children) for children in rounds.values())
    return results, peaks


def merge_rounds(children: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's result from its children in every round: all their runs, the median over
    them, each round's own median, and the latencies and peak RSS of the child nearest the median.
    A failed child fails the system's result."""
    failed = [c for c in children if "error" in c]
    if failed or len(children) == 1:
        return failed[0] if failed else children[0]
    runs = [run for child in children for run in child["runs"]]
    median = statistics.median(run["tok_s"] for run in runs)
    nearest = min(children, key=lambda c: abs(c["tok_s_median"] - median))
    merged = {**nearest, "runs": runs, "tok_s_median": median,
              "round_medians": [c["tok_s_median"] for c in children],
              "peak_rss_mb": max(c.get("peak_rss_mb") or 0 for c in children) or None}
    if all("length_mismatches" in c for c in children):
        merged["length_mismatches"] = sum(c["length_mismatches"] for c in children)
    return merged


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
