"""Network partitions: the router, two prefill and two decode workers each in their own network
namespace, linked pair by pair (tests/cluster/netns.py), KV moving over TCP (`dist`). Each test
cuts links while a request is in flight and heals them: the request must finish with exactly the
offline engine's tokens (no duplicate, no gap) within its deadline, by retry or migration; a
worker cut off from the router leaves placement and re-registers after the heal; every worker's
KV blocks are all free again."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from launch.cluster import REPO_ROOT
from security.auth import new_token
from tests.cluster import netns, netns_client
from tests.cluster.cluster_helpers import long_prompt, offline_greedy, wait_until

pytestmark = pytest.mark.skipif(netns.unavailable() is not None,
                                reason=f"network namespaces: {netns.unavailable()}")

PREFILLS, DECODES = ["prefill-0", "prefill-1"], ["decode-0", "decode-1"]
ROUTER_PORT = 50051
HEARTBEAT_TIMEOUT_S = 2.0
TRANSFER_TIMEOUT_S = 4.0
REQUEST_TIMEOUT_S = 120.0
LONG_DECODE = 96  # tokens: the stream is still going when its link is cut


class NetnsCluster:
    """The cluster's processes, each started in its own namespace, and a client pool inside the
    router's namespace."""

    def __init__(self, parts: netns.Partitions, log_dir: Path, token_file: Path):
        self.parts = parts
        self.log_dir = log_dir
        self.token_file = token_file
        self.address = f"{parts.addresses['router']}:{ROUTER_PORT}"
        self.processes: dict[str, subprocess.Popen] = {}
        self.pool = ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=netns_client.init,
                                        initargs=(parts.namespace("router"),))

    def _spawn(self, node: str, args: list[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log = open(self.log_dir / f"{node}.log", "w")  # noqa: SIM115 - the child owns it
        self.processes[node] = subprocess.Popen(
            [*self.parts.exec_prefix(node), sys.executable, "-m", *args,
             "--cluster-token-file", str(self.token_file)],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start(self) -> NetnsCluster:
        self._spawn("router", ["router", "serve", "--host", self.parts.addresses["router"],
                               "--port", str(ROUTER_PORT), "--http-port", "0", "--insecure",
                               "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)])
        for node in PREFILLS + DECODES:
            role = node.split("-")[0]
            extra = ["--prefill-chunk-size", "64"] if role == "prefill" else []
            self._spawn(node, [f"{role}_worker", "--router", self.address,
                               "--host", self.parts.addresses[node], "--worker-id", node,
                               "--kv-transport", "dist", "--kv-cache-gb", "0.25",
                               "--dtype", "float32",  # the reference's (bf16 CPUs default to bf16)
                               "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), *extra])
        self.wait_for(lambda w: len(w) == 4 and all(x["healthy"] for x in w.values()), 240.0,
                      "four workers registered")
        return self

    def call(self, fn, *args, timeout_s: float = 30.0):  # noqa: ANN001, ANN201 - pool call
        return self.pool.submit(fn, *args).result(timeout=timeout_s)

    def workers(self) -> dict[str, dict]:
        try:
            return self.call(netns_client.workers, self.address)
        except Exception:  # noqa: BLE001 - the router is still starting
            return {}

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
        dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
        assert not dead, f"processes exited (name: exit status): {dead} (logs in {self.log_dir})"
        wait_until(lambda: predicate(self.workers()), timeout_s, what, poll_s=0.3)

    def metric(self, node: str, name: str) -> float:
        """One sample of a worker's /metrics."""
        return self.call(netns_client.metric, self.workers()[node]["metrics"], name)

    def wait_all_free(self) -> None:
        self.wait_for(lambda w: len(w) == 4 and all(x["free"] == x["total"] > 0
                                                    for x in w.values()),
                      60.0, "every worker registered with all its KV blocks free")

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes.values():
            try:
                proc.wait(20.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        self.pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [long_prompt(1400, rank) for rank in range(3)]


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    return offline_greedy(prompts, [8, LONG_DECODE, 8])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, reference):
    tmp = tmp_path_factory.mktemp("partitions")
    token = tmp / "cluster.token"
    token.write_text(new_token())
    token.chmod(0o600)
    links = [("router", w) for w in PREFILLS + DECODES] + [(p, d) for p in PREFILLS
                                                            for d in DECODES]
    with netns.Partitions(["router", *PREFILLS, *DECODES], links) as parts:
        running = NetnsCluster(parts, tmp, token)
        try:
            running.start()
            for i in range(4):  # the pairs rendezvous before the tests cut them
                running.call(netns_client.generate, running.address, [1, 2, 3, 4 + i] * 20, 2,
                             timeout_s=REQUEST_TIMEOUT_S)
            yield running
        finally:
            running.stop()


def router_counter(cluster: NetnsCluster, name: str) -> float:
    return cluster.call(netns_client.router_metric, cluster.address, name)


def heal_all(cluster: NetnsCluster, pairs: list[tuple[str, str]]) -> None:
    for a, b in pairs:
        cluster.parts.heal(a, b)


def test_prefill_decode_cut_mid_transfer_retries_after_the_heal(cluster, prompts, reference):
    streamed = sum(cluster.metric(p, "pdserve_worker_kv_streamed_bytes_total{role=prefill}")
                   for p in PREFILLS)
    retries = router_counter(cluster, "pdserve_router_retries_total{}")
    pending = cluster.pool.submit(netns_client.generate, cluster.address, prompts[0], 8)
    wait_until(lambda: sum(cluster.metric(p, "pdserve_worker_kv_streamed_bytes_total"
                                             "{role=prefill}") for p in PREFILLS) > streamed,
               60.0, "the prompt's KV to start streaming", poll_s=0.05)
    cut = cluster.parts.cut_all(PREFILLS, DECODES)
    # Cut until the transfer has timed out and the router retried (healed earlier, TCP would
    # finish the first transfer after all), then healed for the retry.
    wait_until(lambda: router_counter(cluster, "pdserve_router_retries_total{}") > retries,
               60.0, "the router to retry the cut transfer")
    heal_all(cluster, cut)
    tokens, reason = pending.result(timeout=REQUEST_TIMEOUT_S)
    assert (tokens, reason) == (reference[0], "FINISH_REASON_LENGTH")
    cluster.wait_all_free()


def serving(cluster: NetnsCluster, role: str) -> str:
    """The worker of `role` holding the one request in flight (its metrics, no heartbeat lag)."""
    found: list[str] = []

    def busy() -> bool:
        found[:] = [node for node in (PREFILLS if role == "prefill" else DECODES)
                    if cluster.metric(node, f"pdserve_worker_running_requests{{role={role}}}")]
        return len(found) == 1

    wait_until(busy, 60.0, f"a {role} worker running the request", poll_s=0.05)
    return found[0]


def cut_off_and_heal(cluster: NetnsCluster, node: str) -> None:
    """Cut `node` from the router until the router has dropped it, then heal; it registers
    again."""
    cluster.parts.cut("router", node)
    try:
        cluster.wait_for(lambda w: node not in w, 10 * HEARTBEAT_TIMEOUT_S,
                         f"the router to drop {node}")
    finally:
        cluster.parts.heal("router", node)
    cluster.wait_for(lambda w: w.get(node, {}).get("healthy"), 30.0, f"{node} to register again")


def test_router_decode_cut_mid_stream_migrates_the_request(cluster, prompts, reference):
    migrations = router_counter(cluster, "pdserve_router_migrations_total{}")
    progress = cluster.log_dir / "progress-decode"
    progress.write_text("0")
    pending = cluster.pool.submit(netns_client.generate, cluster.address, prompts[1],
                                  LONG_DECODE, str(progress))
    wait_until(lambda: int(progress.read_text() or 0) >= 8, 60.0, "the stream to start",
               poll_s=0.05)
    cut_off_and_heal(cluster, serving(cluster, "decode"))
    tokens, reason = pending.result(timeout=REQUEST_TIMEOUT_S)
    assert (tokens, reason) == (reference[1], "FINISH_REASON_LENGTH")  # no duplicate, no gap
    assert router_counter(cluster, "pdserve_router_migrations_total{}") > migrations
    cluster.wait_all_free()


def test_router_prefill_cut_mid_prefill_retries_elsewhere(cluster, prompts, reference):
    retries = router_counter(cluster, "pdserve_router_retries_total{}")
    pending = cluster.pool.submit(netns_client.generate, cluster.address, prompts[2], 8)
    cut_off_and_heal(cluster, serving(cluster, "prefill"))
    tokens, reason = pending.result(timeout=REQUEST_TIMEOUT_S)
    assert (tokens, reason) == (reference[2], "FINISH_REASON_LENGTH")
    assert router_counter(cluster, "pdserve_router_retries_total{}") > retries
    cluster.wait_all_free()
