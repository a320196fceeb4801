"""Worker death and drain against one 2P+2D cluster: SIGKILL a prefill worker mid-prefill (the
request is retried), SIGTERM one mid-prefill (it finishes that prefill, then exits), SIGKILL a
decode worker mid-stream (the request migrates), SIGTERM a decode worker and the router
mid-stream (they drain; the decode worker's stream moves to the other one), lose every decode
worker (UNAVAILABLE). Greedy output must equal the offline engine's — no token duplicated or
missing — and no live worker may keep a KV block. Each test leaves the cluster with its workers
replaced."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import Future

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from tests.cluster.cluster_helpers import (
    greedy_params,
    greedy_request,
    long_prompt,
    offline_outputs,
    scrape,
    start_cluster,
    stream_tokens,
    wait_blocks_free,
    wait_until,
    worker_status,
)

pytestmark = pytest.mark.slow
HEARTBEAT_TIMEOUT_S = 3.0
SHORT_PROMPT = list(range(1000, 1024))
LONG_TOKENS, SHORT_TOKENS = 8, 200


def sampled_request() -> pb.GenerateRequest:
    """Seeded sampling with penalties: a migration must not change what it draws."""
    request = greedy_request(SHORT_PROMPT, SHORT_TOKENS)
    request.sampling.temperature, request.sampling.seed = 0.8, 3
    request.sampling.frequency_penalty, request.sampling.presence_penalty = 0.5, 0.2
    return request


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """The offline engine's tokens, computed before any cluster process starts."""
    from common.convert import sampling_from_proto

    outputs = offline_outputs(
        [long_prompt(), SHORT_PROMPT, long_prompt()[7:], SHORT_PROMPT],
        [greedy_params(LONG_TOKENS), greedy_params(SHORT_TOKENS), greedy_params(LONG_TOKENS),
         sampling_from_proto(sampled_request().sampling)])
    return dict(zip(("long", "short", "drained", "sampled"), (o.token_ids for o in outputs)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, reference):
    with start_cluster(tmp_path_factory.mktemp("faults"), prefill=2, decode=2, dtype="float32",
                       router_args=("--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S))
                       ) as running:
        yield running


def _in_background(address: str, request: pb.GenerateRequest) -> Future:
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(stream_tokens(address, request)[0])
        except BaseException as exc:  # handed to the test
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def _busy_worker(cluster, role: int, field: str) -> str:
    found: list[str] = []

    def busy() -> bool:
        found[:] = [w.worker_id for w in cluster.status().workers
                    if w.role == role and getattr(w, field) > 0]
        return bool(found)

    wait_until(busy, 60.0, f"a worker with {field} > 0")
    return found[0]


def _prefilling_worker(cluster) -> str:
    """A prefill worker computing a prompt by its own count. The router's status adds the
    prompts it placed there before they arrive, so a worker picked from it may not have the
    request yet: drained then, it would refuse it."""
    found: list[str] = []

    def busy() -> bool:
        found[:] = [w.worker_id for w in cluster.status().workers
                    if w.role == pb.WORKER_ROLE_PREFILL and scrape(w.metrics_address).get(
                        "pdserve_worker_queued_prompt_tokens{role=prefill}", 0.0) > 0]
        return bool(found)

    wait_until(busy, 60.0, "a prefill worker computing a prompt")
    return found[0]


def _wait_not_serving(address: str) -> None:
    """Until the server's health says NOT_SERVING, or it is gone already (a drain with little to
    do may finish before the first look)."""

    def not_serving() -> bool:
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status \
                == health_pb2.HealthCheckResponse.NOT_SERVING
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                return True
            raise

    with channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        wait_until(not_serving, 30.0, "NOT_SERVING")


def _wait_dropped(cluster, worker_id: str) -> None:
    """The router forgets a dead worker after its heartbeat timeout (plus a reaper tick; the
    margin is for a loaded machine)."""
    wait_until(lambda: worker_status(cluster, worker_id) is None, HEARTBEAT_TIMEOUT_S + 30.0,
               f"the router to drop {worker_id}")


def _replace(cluster, role: str, count: int) -> None:
    cluster.spawn_worker(role)
    cluster.wait_workers(count, 240.0)


def _assert_no_leak(cluster) -> None:
    workers = wait_blocks_free(cluster)
    assert all(w.free_blocks == w.total_blocks for w in workers), workers


def _router_counter(cluster, name: str) -> float:
    return scrape(cluster.status().metrics_address).get(name, 0.0)


@pytest.fixture()
def stub(cluster):
    with channel(cluster.address) as ch:
        yield pb_grpc.GenerationStub(ch)


def _stream_until(stub, request: pb.GenerateRequest, tokens: int):  # noqa: ANN001, ANN202
    """Start a stream; return (call, tokens seen) once it produced at least `tokens`."""
    call = stub.Generate(request, timeout=300)
    seen: list[int] = []
    for part in call:
        seen.extend(part.token_ids)
        if len(seen) >= tokens:
            return call, seen
    raise AssertionError("the stream ended early")


def _rest(call, seen: list[int]) -> list[int]:
    for part in call:
        seen.extend(part.token_ids)
    return seen


def test_prefill_worker_killed_mid_prefill_is_retried_on_another(cluster, reference):
    retries = _router_counter(cluster, "pdserve_router_retries_total{}")
    result = _in_background(cluster.address, greedy_request(long_prompt(), LONG_TOKENS))
    victim = _busy_worker(cluster, pb.WORKER_ROLE_PREFILL, "queued_prompt_tokens")
    cluster.signal(victim, signal.SIGKILL)
    assert result.result(timeout=240) == reference["long"]  # once, complete, correct
    assert _router_counter(cluster, "pdserve_router_retries_total{}") == retries + 1
    _wait_dropped(cluster, victim)
    _assert_no_leak(cluster)
    _replace(cluster, "prefill", 4)


def test_sigterm_drains_a_prefill_worker_after_its_accepted_prefill(cluster, reference):
    retries = _router_counter(cluster, "pdserve_router_retries_total{}")
    # A prompt no worker has cached, so the prefill is still running when SIGTERM arrives.
    result = _in_background(cluster.address, greedy_request(long_prompt()[7:], LONG_TOKENS))
    victim = _prefilling_worker(cluster)
    process = cluster.signal(victim, signal.SIGTERM)
    assert result.result(timeout=240) == reference["drained"]
    assert _router_counter(cluster, "pdserve_router_retries_total{}") == retries  # done there
    assert process.wait(timeout=60) == 0
    _wait_dropped(cluster, victim)
    _assert_no_leak(cluster)
    _replace(cluster, "prefill", 4)


def test_decode_worker_killed_mid_stream_migrates_without_duplicates(cluster, stub, reference):
    """Seeded and penalized: the continuation counts the streamed tokens as output
    (sampling.continued_tokens), so it draws what the undisturbed request would have."""
    migrations = _router_counter(cluster, "pdserve_router_migrations_total{}")
    call, seen = _stream_until(stub, sampled_request(), 5)
    victim = _busy_worker(cluster, pb.WORKER_ROLE_DECODE, "running_requests")
    cluster.signal(victim, signal.SIGKILL)
    assert _rest(call, seen) == reference["sampled"]
    assert _router_counter(cluster, "pdserve_router_migrations_total{}") == migrations + 1
    _wait_dropped(cluster, victim)
    _assert_no_leak(cluster)
    _replace(cluster, "decode", 4)


def test_sigterm_drains_a_decode_worker(cluster, stub, reference):
    call, seen = _stream_until(stub, greedy_request(SHORT_PROMPT, 120), 3)
    victim = _busy_worker(cluster, pb.WORKER_ROLE_DECODE, "running_requests")
    address = worker_status(cluster, victim).address
    process = cluster.signal(victim, signal.SIGTERM)
    _wait_not_serving(address)
    # Drained (or already gone, its stream moved): the router knows either way.
    wait_until(lambda: (status := worker_status(cluster, victim)) is None or status.draining,
               30.0, "the router to know")
    # New work goes to the other decode worker; the old stream moves there with its KV (live
    # migration: tests/cluster/test_live_migration.py checks the move itself).
    assert stream_tokens(cluster.address, greedy_request(SHORT_PROMPT, 6))[0] == \
        reference["short"][:6]
    assert _rest(call, seen) == reference["short"][:120]
    assert process.wait(timeout=60) == 0
    _assert_no_leak(cluster)
    _replace(cluster, "decode", 4)


def test_with_no_decode_worker_left_the_request_fails_unavailable(cluster, stub):
    call, seen = _stream_until(stub, greedy_request(SHORT_PROMPT, SHORT_TOKENS), 3)
    decoders = [w.worker_id for w in cluster.status().workers
                if w.role == pb.WORKER_ROLE_DECODE]
    for worker_id in decoders:
        cluster.signal(worker_id, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as failed:
        _rest(call, seen)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    for worker_id in decoders:
        _wait_dropped(cluster, worker_id)
    _assert_no_leak(cluster)  # the prefill workers hold nothing either
    _replace(cluster, "decode", 3)


def test_sigterm_drains_the_router(cluster, stub, reference):
    call, seen = _stream_until(stub, greedy_request(SHORT_PROMPT, 60), 2)
    router = cluster.signal("router", signal.SIGTERM)
    _wait_not_serving(cluster.address)
    with pytest.raises(grpc.RpcError) as refused:
        stream_tokens(cluster.address, greedy_request(SHORT_PROMPT, 4), timeout_s=10)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert _rest(call, seen) == reference["short"][:60]
    assert router.wait(timeout=60) == 0


def _rank_processes(parent: int) -> list[int]:
    """The tensor-parallel rank processes a worker started (multiprocessing spawns them)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue
        if ppid == parent and b"spawn_main" in command:
            found.append(int(entry))
    return found


def test_a_tensor_parallel_rank_killed_mid_stream_takes_its_worker_down(tmp_path, reference):
    """Two colocated workers of 2 ranks each: SIGKILL one rank of the worker serving a stream;
    the worker fails its step, exits as a unit (code 1) and the request migrates to the other,
    its output unchanged."""
    with start_cluster(tmp_path, prefill=0, decode=0, colocated=2, dtype="float32",
                       tensor_parallel_size=2, router_args=(
                           "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S))) as cluster:
        with channel(cluster.address) as ch:
            call, seen = _stream_until(pb_grpc.GenerationStub(ch),
                                       greedy_request(SHORT_PROMPT, 60), 5)
            victim = _busy_worker(cluster, pb.WORKER_ROLE_COLOCATED, "running_requests")
            process = cluster.processes[victim]
            (rank,) = _rank_processes(process.pid)
            cluster.signalled.add(victim)  # it is meant to exit
            os.kill(rank, signal.SIGKILL)
            assert _rest(call, seen) == reference["short"][:60]
        assert _router_counter(cluster, "pdserve_router_migrations_total{}") == 1
        assert process.wait(timeout=60) == 1
        _wait_dropped(cluster, victim)
        _assert_no_leak(cluster)
