"""benchmarks.engine_start: both trees start an engine in fresh processes, the figures are
summarized pair by pair, and the temporary worktree is gone afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.engine_start import compare, main, summarize
from tests.engine.worktree_runs import start_worktree_test, worktrees


def test_starts_head_beside_itself_and_removes_the_worktree(tiny_llama_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    before = start_worktree_test(monkeypatch)
    report = compare("HEAD", 1, str(tiny_llama_dir), "float32", 1, timeout=300)
    for name in ("earlier", "this"):
        (start,) = report["starts"][name]
        assert start["import_s"] > 0 and start["build_s"] > 0 and start["build_cpu_s"] > 0
    assert report["ratio"]["build_s"] == (report["median"]["this"]["build_s"]
                                          / report["median"]["earlier"]["build_s"])
    assert worktrees() == before


def test_summary_takes_medians_per_tree_and_ratios_per_pair():
    def start(import_s: float, build_s: float) -> dict[str, float]:
        return {"import_s": import_s, "build_s": build_s, "import_cpu_s": import_s,
                "build_cpu_s": build_s}

    starts = {"earlier": [start(2, 4), start(2, 2), start(3, 3)],
              "this": [start(1, 2), start(2, 2), start(1, 3)]}
    report = summarize(starts)
    assert report["median"]["earlier"]["build_s"] == 3
    assert report["median"]["this"]["total_s"] == 4  # of 3, 4 and 4
    assert report["ratio"]["build_s"] == pytest.approx(2 / 3)
    assert report["pair_ratios"]["build_s"] == [0.5, 1.0, 1.0]
    assert report["pair_ratios"]["total_s"] == [0.5, 1.0, pytest.approx(4 / 6)]


def test_refuses_zero_runs_or_threads():
    for args in (["--runs", "0"], ["--threads", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["--commit", "HEAD", *args])
        assert exc.value.code == 2
