"""benchmarks.against_commit: both trees run the default model on a one-request workload, and
the temporary worktree is gone afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.against_commit import REPO, compare, main
from benchmarks.common import tree_env
from tests.engine.worktree_runs import start_worktree_test, worktrees


@pytest.fixture
def tiny_workload(tmp_path: Path) -> str:
    row = {"id": "r0", "prompt": "", "prompt_token_ids": list(range(1, 21)), "max_tokens": 4,
           "ignore_eos": True}
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return str(path)


def test_compares_head_with_itself_and_removes_the_worktree(tiny_workload: str,
                                                           monkeypatch: pytest.MonkeyPatch):
    before = start_worktree_test(monkeypatch)
    report = compare("HEAD", 1, "float32", tiny_workload, timeout=600)
    assert len(report["tok_s"]["earlier"]) == len(report["tok_s"]["this"]) == 1
    assert report["median"]["earlier"] > 0 and report["median"]["this"] > 0
    assert report["ratio"] == report["median"]["this"] / report["median"]["earlier"]
    assert worktrees() == before


def test_refuses_zero_runs():
    with pytest.raises(SystemExit) as exc:
        main(["--commit", "HEAD", "--runs", "0"])
    assert exc.value.code == 2


def test_an_earlier_tree_builds_its_kernels_beside_it(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch):
    """torch keys a kernel's build folder by name: two trees sharing one would rebuild it in
    turn. The earlier tree's folder sits beside it (removed with it); this checkout's is the
    usual one."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/usual")
    earlier = tmp_path / "tree"
    assert tree_env(earlier)["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "torch_extensions")
    assert tree_env(REPO)["TORCH_EXTENSIONS_DIR"] == "/usual"
    assert tree_env(earlier, {"A": "1"}) == {"A": "1", "TORCH_EXTENSIONS_DIR":
                                            str(tmp_path / "torch_extensions")}
