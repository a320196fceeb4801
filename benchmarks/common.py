"""Shared helpers for the offline benchmarks: workload loading, percentiles, RSS, child results."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtest.workloads import OFFLINE_MIXED

DEFAULT_WORKLOAD = str(OFFLINE_MIXED)
PERCENTILES = (50, 90, 99)

Row = dict[str, Any]


def load_workload(path: str | Path) -> list[Row]:
    """Rows of {"id", "prompt", "prompt_token_ids", "max_tokens", "ignore_eos"}, in file order."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"workload {str(path)!r} is empty")
    return rows


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for an empty list."""
    if not values:
        return float("nan")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def latency_stats(token_times: dict[str, list[float]], start: float) -> dict[str, float]:
    """TTFT (start → first token) and inter-token gaps, pooled over requests, in milliseconds."""
    ttft = [(times[0] - start) * 1e3 for times in token_times.values() if times]
    itl = [
        (b - a) * 1e3
        for times in token_times.values()
        for a, b in zip(times, times[1:])
    ]
    stats: dict[str, float] = {}
    for q in PERCENTILES:
        stats[f"ttft_p{q}"] = percentile(ttft, q)
        stats[f"itl_p{q}"] = percentile(itl, q)
    return stats


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def loadavg_1m() -> float:
    return os.getloadavg()[0]


def summarize_runs(system: str, dtype: str, runs: list[dict[str, Any]],
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Child result: every run, the median tok/s, and the latencies of the median run."""
    rates = [r["tok_s"] for r in runs]
    median = statistics.median(rates)
    median_run = min(runs, key=lambda r: abs(r["tok_s"] - median))
    result: dict[str, Any] = {
        "system": system,
        "dtype": dtype,
        "runs": runs,
        "tok_s_median": median,
        "latency": median_run.get("latency", {}),
        "peak_rss_mb": peak_rss_mb(),
    }
    if all("length_mismatches" in r for r in runs):
        result["length_mismatches"] = sum(r["length_mismatches"] for r in runs)
    result.update(extra or {})
    return result


REPO = Path(__file__).resolve().parents[1]


@contextmanager
def commit_tree(commit: str) -> Iterator[Path]:
    """`commit` checked out (detached) into a temporary git worktree, removed on exit: the
    earlier tree of the benchmarks that compare two commits side by side."""
    with tempfile.TemporaryDirectory(prefix="pdserve-base-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO,
                       check=True, capture_output=True, timeout=120)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO,
                           check=False, capture_output=True, timeout=120)


def tree_env(tree: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process that runs `tree`'s code. An earlier tree builds its
    native CPU kernels in a folder of its own beside it, removed with it: torch keys a build
    folder by the kernel's name alone, and the same source at another path rebuilds it there,
    so two trees taking turns rebuilt every kernel on each turn (12 s for the argmax kernel
    alone, measured on 2 cores). This checkout keeps the usual folder."""
    env = dict(os.environ if base is None else base)
    if tree.resolve() != REPO:
        env["TORCH_EXTENSIONS_DIR"] = str(tree.parent / "torch_extensions")
    return env


def head_commit() -> str:
    """This checkout's commit, abbreviated ("" outside a git checkout)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True, timeout=30).stdout.strip()


def file_at(rev: str, path: str) -> bytes:
    """The bytes of `path` (relative to the repository root) at git revision `rev`: a kernel's
    earlier source, built beside the tree's to compare the two."""
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True,
                          capture_output=True).stdout


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=1, default=str))


def check_lengths(rows: list[Row], lengths: dict[str, int]) -> list[str]:
    """Row ids whose generated length differs from their max_tokens (empty when all match)."""
    return [r["id"] for r in rows if lengths.get(r["id"]) != r["max_tokens"]]


def replace_marked(text: str, body: list[str], title: str, start: str, end: str) -> str:
    """`text` (BENCHMARKS.md) with the section between the `start` and `end` markers replaced
    by `body`, or, the first time, appended under `title`."""
    block = "\n".join([start, *body, end])
    if start in text and end in text:
        return text[:text.index(start)] + block + text[text.index(end) + len(end):]
    return text.rstrip("\n") + f"\n\n{title}\n\n{block}\n"
