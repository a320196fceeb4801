"""What the tests of the benchmarks that check an earlier commit out into a temporary worktree
share (benchmarks.common.commit_tree): the worktrees as git lists them, and a test's setup."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engine.native_kernels import ALL_SWITCHES

REPO = Path(__file__).resolve().parents[2]


def worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=30).stdout


def start_worktree_test(monkeypatch: pytest.MonkeyPatch) -> str:
    """Skip outside a git checkout; switch every native kernel off (a fresh worktree would
    build each once, a minute or so on 2 cores, which is not what is tested); the worktrees
    before the test, which it must leave as they were."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for switch in ALL_SWITCHES:
        monkeypatch.setenv(switch, "1")
    return worktrees()
