"""A build lock left by a killed builder never makes a later build wait forever, and a prebuild
stopped with SIGTERM (`python -m engine build-kernels` in the background) leaves none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import native_build
from engine.native_build import STALE_LOCK_S, wait_for_build_lock

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_prebuild_stopped_mid_build_releases_its_lock(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    builder = subprocess.Popen([sys.executable, "-m", "engine", "build-kernels"], cwd=ROOT,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*/lock")):
            if builder.poll() is not None:
                pytest.skip("nothing builds here (no compiler, or every kernel disabled)")
            assert time.monotonic() < deadline, "no build started within 120 s"
            time.sleep(0.05)
        builder.send_signal(signal.SIGTERM)
        assert builder.wait(timeout=60) == 1
        assert list(tmp_path.glob("*/lock")) == []  # a later build would not wait on it
    finally:
        try:
            os.killpg(builder.pid, signal.SIGKILL)  # it, or the compiler it left running
        except ProcessLookupError:
            pass
        builder.wait(timeout=30)
