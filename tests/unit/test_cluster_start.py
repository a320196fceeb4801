"""LocalCluster.start when the router's port is taken between free_port and the router's bind:
the router exits during start, and a cluster whose ports are its own choosing starts again on
fresh ones; a cluster given its port does not. Processes are stand-ins (`python -c`), so nothing
loads a model."""

from __future__ import annotations

import subprocess
import sys

import pytest

import launch.cluster as cluster_module
from launch.cluster import START_ATTEMPTS, ClusterSpec, LocalCluster, RouterExited


class _StandIns:
    """Replaces LocalCluster._spawn: the first `exits` routers exit at once (their port was
    taken), later ones keep running; workers always keep running."""

    def __init__(self, exits: int) -> None:
        self.exits = exits
        self.routers: list[str] = []  # each router start's address

    def spawn(self, cluster: LocalCluster, name: str, args: list[str]) -> None:
        code = "import time; time.sleep(60)"
        if name == "router":
            self.routers.append(cluster.address)
            if len(self.routers) <= self.exits:
                code = "import sys; sys.exit(1)"
        cluster.processes[name] = subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def stand_ins(monkeypatch):
    def make(exits: int) -> _StandIns:
        fake = _StandIns(exits)
        monkeypatch.setattr(LocalCluster, "_spawn",
                            lambda self, name, args: fake.spawn(self, name, args))
        monkeypatch.setattr(LocalCluster, "wait_workers", lambda self, n, t: None)
        return fake
    return make


def _stop(cluster: LocalCluster) -> None:
    cluster.stop(timeout_s=5.0)


def test_a_router_that_exits_is_started_again_on_fresh_ports(stand_ins, monkeypatch):
    fake = stand_ins(exits=1)
    # only a router after the first answers its health check
    monkeypatch.setattr(cluster_module, "wait_healthy",
                        lambda address, *a: fake.routers[-1] == address and len(fake.routers) > 1)
    cluster = LocalCluster(ClusterSpec(prefill=1, decode=1, model="m", port=0))
    try:
        cluster.start()
        assert len(fake.routers) == 2 and fake.routers[0] != fake.routers[1]
        assert cluster.address == fake.routers[1]
        assert sorted(cluster.processes) == ["decode-0", "prefill-0", "router"]
        assert all(p.poll() is None for p in cluster.processes.values())
    finally:
        _stop(cluster)


def test_it_gives_up_after_its_attempts(stand_ins, monkeypatch):
    fake = stand_ins(exits=START_ATTEMPTS)
    monkeypatch.setattr(cluster_module, "wait_healthy", lambda *a: False)
    cluster = LocalCluster(ClusterSpec(prefill=1, decode=1, model="m", port=0))
    with pytest.raises(RouterExited, match="exited during start"):
        cluster.start()
    assert len(fake.routers) == START_ATTEMPTS
    assert all(p.poll() is not None for p in cluster.processes.values())  # nothing left running


def test_a_port_given_by_the_caller_is_not_retried(stand_ins, monkeypatch):
    fake = stand_ins(exits=1)
    monkeypatch.setattr(cluster_module, "wait_healthy", lambda *a: False)
    cluster = LocalCluster(ClusterSpec(prefill=1, decode=1, model="m", port=5))
    with pytest.raises(RouterExited):
        cluster.start()
    assert fake.routers == ["127.0.0.1:5"]


def test_a_signal_during_start_stops_what_started_at_once(monkeypatch):
    """A SIGTERM while the workers load ends the launch then, every process stopped: it used to
    wait for the whole start (minutes), and a supervisor's SIGKILL after its grace period left
    every process running."""
    import os
    import signal
    import threading
    import time

    from launch.run import run_until_interrupted

    started: list[subprocess.Popen] = []

    def start_once(self: LocalCluster) -> None:
        self.processes["router"] = subprocess.Popen([sys.executable, "-c",
                                                     "import time; time.sleep(60)"])
        started.append(self.processes["router"])
        time.sleep(60)  # the workers still loading

    monkeypatch.setattr(LocalCluster, "_start_once", start_once)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    try:
        code = run_until_interrupted(ClusterSpec(model="m", decode=1, prefill=1), None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert code == 130  # interrupted, not after the start's 60 s
    assert started and started[0].poll() is not None  # stopped, not orphaned
