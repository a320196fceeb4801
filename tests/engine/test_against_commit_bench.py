"""benchmarks.against_commit: both trees run the default model on a one-request workload, and
the temporary worktree is gone afterwards."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.against_commit import REPO, compare, main
from engine.attention.cpu_kernel import DISABLE_ENV
from engine.models.cpu_elementwise import DISABLE_ENV as ELEMENTWISE_DISABLE_ENV


def _worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=30).stdout


@pytest.fixture
def tiny_workload(tmp_path: Path) -> str:
    row = {"id": "r0", "prompt": "", "prompt_token_ids": list(range(1, 21)), "max_tokens": 4,
           "ignore_eos": True}
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return str(path)


def test_compares_head_with_itself_and_removes_the_worktree(tiny_workload: str,
                                                           monkeypatch: pytest.MonkeyPatch):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    # The fresh worktree would JIT-build the native CPU kernels again (~1 min each, twice: the
    # build directory is keyed by name, and a source at another path rebuilds it for each tree in
    # turn): not what is tested.
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setenv(ELEMENTWISE_DISABLE_ENV, "1")
    before = _worktrees()
    report = compare("HEAD", 1, "float32", tiny_workload, timeout=600)
    assert len(report["tok_s"]["earlier"]) == len(report["tok_s"]["this"]) == 1
    assert report["median"]["earlier"] > 0 and report["median"]["this"] > 0
    assert report["ratio"] == report["median"]["this"] / report["median"]["earlier"]
    assert _worktrees() == before


def test_refuses_zero_runs():
    with pytest.raises(SystemExit) as exc:
        main(["--commit", "HEAD", "--runs", "0"])
    assert exc.value.code == 2
