"""A build lock left by a killed builder never makes a later build wait forever."""

from __future__ import annotations

import os
import time

from engine import native_build
from engine.native_build import STALE_LOCK_S, wait_for_build_lock


def test_a_stale_lock_is_removed_and_a_live_one_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert wait_for_build_lock("mod") is False  # no lock: nothing to wait for
    lock = tmp_path / "mod" / "lock"
    lock.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert wait_for_build_lock("mod") is True
    assert not lock.exists()
    # A fresh lock is another process building: waited on until it goes (here: after 2 polls).
    lock.touch()
    polls = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 2:
            lock.unlink()

    monkeypatch.setattr(native_build.time, "sleep", sleep)
    assert wait_for_build_lock("mod", poll_s=0.01) is False
    assert polls == [0.01, 0.01]
