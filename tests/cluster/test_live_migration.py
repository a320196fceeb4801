"""Live KV migration on 1P+2D clusters (the shared transport, and dist): running requests move to
the other decode worker with their KV — on SIGTERM (drain), on `pdserve drain` (operator) and off
a decode worker filling up (rebalance) — and go on as if undisturbed: token-identical to the
offline engine, no prompt computed again (the prefill worker takes no step, the router counts no
recompute), no block left held anywhere. A target killed mid-move makes the request recompute
once instead, with the same output (and so does a source killed mid-move). Prompts are
prefilled by the prefill worker only (--local-prefill off), so "no recompute" is visible on
it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from cli.cluster import main as router_cli
from common.grpc_server import channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from tests.cluster.cluster_helpers import (
    greedy_params,
    greedy_request,
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
PROMPT = list(range(1000, 1024))
TOKENS = 200
# Rebalance: 6 streams of 24 + 200 tokens need 84 blocks of 16; a decode cache of 0.05 GB holds
# about 72 (SmolLM2-135M in float32), so alone it must preempt.
CROWD = [list(range(2000 + 100 * i, 2024 + 100 * i)) for i in range(6)]
KV_CACHE_GB = 0.05


def sampled_request() -> pb.GenerateRequest:
    """Seeded sampling with penalties: the target counts the moved tokens as output."""
    request = greedy_request(list(range(3000, 3024)), TOKENS)
    request.sampling.temperature, request.sampling.seed = 0.8, 11
    request.sampling.frequency_penalty, request.sampling.presence_penalty = 0.5, 0.2
    return request


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    from common.convert import sampling_from_proto

    request = sampled_request()
    outputs = offline_outputs([PROMPT, *CROWD, list(request.prompt_token_ids.ids)],
                              [greedy_params(TOKENS)] * (1 + len(CROWD))
                              + [sampling_from_proto(request.sampling)])
    tokens = [o.token_ids for o in outputs]
    return {"greedy": tokens[0], "crowd": tokens[1:-1], "sampled": tokens[-1]}


@pytest.fixture(scope="module", params=["shared", "dist"])
def cluster(request, tmp_path_factory, reference):
    with start_cluster(tmp_path_factory.mktemp(f"moves-{request.param}"), prefill=1, decode=2,
                       dtype="float32", kv_cache_gb=KV_CACHE_GB, kv_transport=request.param,
                       router_args=("--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
                                    "--local-prefill", "off", "--rebalance-threshold", "0.75")
                       ) as running:
        yield running


def _admin(cluster, worker_id: str, undo: bool = False) -> pb.DrainWorkerResponse:
    with channel(cluster.address) as ch:
        return pb_grpc.RouterAdminStub(ch).DrainWorker(
            pb.DrainWorkerRequest(worker_id=worker_id, undo=undo), timeout=10)


def _decoders(cluster) -> list[str]:
    return sorted(w.worker_id for w in cluster.status().workers
                  if w.role == pb.WORKER_ROLE_DECODE)


def _counter(address: str, name: str) -> float:
    return scrape(address).get(name, 0.0)


def _router(cluster, name: str) -> float:
    return _counter(cluster.status().metrics_address, name)


def _prefill_steps(cluster) -> float:
    (prefill,) = [w for w in cluster.status().workers if w.role == pb.WORKER_ROLE_PREFILL]
    return _counter(prefill.metrics_address, 'pdserve_worker_engine_steps_total{role=prefill}')


def _moved(cluster, cause: str, outcome: str = "moved") -> float:
    return _router(cluster, "pdserve_router_live_migrations_total"
                            f"{{cause={cause},outcome={outcome}}}")


def _blocks_used(cluster, worker_id: str) -> float:
    """KV blocks held on a worker, by its own /metrics."""
    status = worker_status(cluster, worker_id)
    return _counter(status.metrics_address, "pdserve_worker_kv_blocks_used{role=decode}")


def _streams(cluster, requests: list[pb.GenerateRequest]) -> tuple[list[Future], list[int]]:
    """Stream each request in the background; the futures of (tokens, last message), and a
    list of token counts (one per stream) the threads keep up to date."""
    counts = [0] * len(requests)
    futures: list[Future] = []
    for i, request in enumerate(requests):
        future: Future = Future()

        def run(i: int = i, request: pb.GenerateRequest = request, future: Future = future
                ) -> None:
            try:
                tokens, _, last = stream_tokens(cluster.address, request, 300.0,
                                                progress=lambda n, i=i: counts.__setitem__(i, n))
                future.set_result((tokens, last))
            except BaseException as exc:  # handed to the test
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        futures.append(future)
    return futures, counts


def _assert_no_leak(cluster) -> None:
    workers = wait_blocks_free(cluster)
    assert all(w.free_blocks == w.total_blocks for w in workers), workers


def _replace_decoders(cluster, gone: list[str]) -> None:
    """Wait until the router forgot `gone`, then start decode workers back up to two."""
    for worker_id in gone:
        wait_until(lambda w=worker_id: worker_status(cluster, w) is None,
                   HEARTBEAT_TIMEOUT_S + 30.0, f"the router to forget {worker_id}")
    for _ in range(2 - len(_decoders(cluster))):
        cluster.spawn_worker("decode")
    cluster.wait_workers(3, 240.0)


@pytest.fixture()
def on_one_decoder(cluster) -> Iterator[tuple[str, str]]:
    """(victim, other): new requests go to the victim only, until the test lets the other take
    work again (it must, before moving anything)."""
    victim, other = _decoders(cluster)
    _admin(cluster, other)
    yield victim, other
    if worker_status(cluster, other) is not None:
        _admin(cluster, other, undo=True)


def test_sigterm_moves_running_requests_with_their_kv(cluster, reference, on_one_decoder):
    victim, other = on_one_decoder
    recomputed = _router(cluster, "pdserve_router_migrations_total{}")
    moved = _moved(cluster, "drain")
    futures, counts = _streams(cluster, [greedy_request(PROMPT, TOKENS), sampled_request()])
    wait_until(lambda: min(counts) >= 5, 120.0, "both streams under way")
    steps = _prefill_steps(cluster)
    assert steps > 0  # it prefilled both
    _admin(cluster, other, undo=True)
    process = cluster.signal(victim, signal.SIGTERM)
    (greedy, last), (sampled, _) = (f.result(timeout=300) for f in futures)
    assert greedy == reference["greedy"] and sampled == reference["sampled"]
    assert last.timings.live_migrations == 1 and last.timings.live_migration_bytes > 0
    assert _moved(cluster, "drain") == moved + 2
    assert _router(cluster, "pdserve_router_migrations_total{}") == recomputed  # nothing redone
    assert _prefill_steps(cluster) == steps  # no prompt computed again
    assert process.wait(timeout=60) == 0  # it drained: nothing was left to wait for
    _assert_no_leak(cluster)
    _replace_decoders(cluster, [victim])


def _kill_mid_move(cluster, reference, monkeypatch, victim_role: str) -> None:
    """A stream on a decode worker that stalls 10 s inside each move (fault injection) is moved
    off it by SIGTERM; the move's target (or source) is SIGKILLed meanwhile. The request must
    recompute once, elsewhere, with the same output, and nothing may stay held."""
    spare, target = _decoders(cluster)
    _admin(cluster, spare)
    _admin(cluster, target)
    # For the source started now; long, so a loaded machine cannot let the pause end first.
    monkeypatch.setenv("PDSERVE_FAULT_MOVE_PAUSE_S", "10")
    source = cluster.spawn_worker("decode")
    cluster.wait_workers(4, 240.0)
    recomputed = _router(cluster, "pdserve_router_migrations_total{}")
    failed = _moved(cluster, "drain", "failed")
    futures, counts = _streams(cluster, [greedy_request(PROMPT, TOKENS)])
    wait_until(lambda: counts[0] >= 5, 120.0, "the stream under way")
    _admin(cluster, target, undo=True)
    process = cluster.signal(source, signal.SIGTERM)
    # The target's own gauge, not the router's status: the router counts the blocks it placed
    # there before the Reserve call reaches the target, and a kill before the Reserve arrives
    # makes the router try elsewhere instead of failing the move.
    wait_until(lambda: _blocks_used(cluster, target) > 0, 10.0, "the target's reservation")
    # The Reserve's reply may still be on its way: kill once the router surely sent MigrateOut,
    # well inside the source's 10 s pause (a Reserve failing instead would move it elsewhere).
    time.sleep(1.0)
    killed = target if victim_role == "target" else source
    cluster.signal(killed, signal.SIGKILL)
    _admin(cluster, spare, undo=True)  # somewhere to recompute besides the target
    tokens, last = futures[0].result(timeout=300)
    assert tokens == reference["greedy"]
    assert _moved(cluster, "drain", "failed") == failed + 1
    assert _router(cluster, "pdserve_router_migrations_total{}") == recomputed + 1  # once
    assert last.timings.live_migrations == 0
    if killed is target:
        assert process.wait(timeout=60) == 0  # the source freed the KV once the move failed
    _replace_decoders(cluster, [killed] if killed is source else [source, target])
    _assert_no_leak(cluster)


def test_a_target_killed_mid_move_makes_the_request_recompute_once(cluster, reference,
                                                                  monkeypatch):
    _kill_mid_move(cluster, reference, monkeypatch, "target")


@pytest.mark.parametrize("cluster", ["shared"], indirect=True)
def test_a_source_killed_mid_move_makes_the_request_recompute_once(cluster, reference,
                                                                  monkeypatch):
    _kill_mid_move(cluster, reference, monkeypatch, "source")


def _choices(cluster, request: pb.GenerateRequest, counts: list[int]) -> Future:
    """Stream a request of n choices in the background: its future is {index: (tokens, last
    message)}; `counts[0]` follows the tokens received."""
    future: Future = Future()

    def run() -> None:
        try:
            out: dict[int, tuple[list[int], pb.GenerateResponse]] = {}
            with channel(cluster.address) as ch:
                for part in pb_grpc.GenerationStub(ch).Generate(request, timeout=300):
                    tokens, _ = out.get(part.index, ([], part))
                    tokens.extend(part.token_ids)
                    out[part.index] = (tokens, part)
                    counts[0] += len(part.token_ids)
            future.set_result(out)
        except BaseException as exc:  # handed to the test
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


@pytest.mark.parametrize("cluster", ["shared"], indirect=True)
def test_an_operator_drain_moves_requests_and_undo_places_again(cluster, reference, capsys):
    """Two samples of one prompt (the second forked from the first's KV there) move together."""
    request = greedy_request(PROMPT, TOKENS)
    request.n = 2
    counts = [0]
    future = _choices(cluster, request, counts)
    wait_until(lambda: counts[0] >= 10, 120.0, "the samples under way")
    busy: list[str] = []
    wait_until(lambda: bool(busy.extend(w.worker_id for w in cluster.status().workers
                                        if w.role == pb.WORKER_ROLE_DECODE
                                        and w.running_requests) or busy), 10.0,
               "the decode worker's report")
    (victim,) = set(busy)
    moved = _moved(cluster, "operator")
    assert router_cli(["drain", victim, "--router", cluster.address]) == 0
    assert f"{victim}: draining" in capsys.readouterr().out
    choices = future.result(timeout=300)
    assert [choices[i][0] for i in (0, 1)] == [reference["greedy"]] * 2
    assert [choices[i][1].timings.live_migrations for i in (0, 1)] == [1, 1]
    assert choices[1][1].timings.prefill_site == "fork"
    assert _moved(cluster, "operator") == moved + 2
    assert worker_status(cluster, victim).draining
    assert router_cli(["drain", victim, "--router", cluster.address, "--undo"]) == 0
    assert not worker_status(cluster, victim).draining
    assert router_cli(["drain", "no-such-worker", "--router", cluster.address]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    _assert_no_leak(cluster)


def _crowd(cluster, reference, on_one_decoder, rebalance: bool) -> tuple[float, float]:
    """Six streams on one decode worker whose cache cannot hold them all; with `rebalance`
    the other decode worker takes work once they run. The victim's preemptions and the
    rebalancing moves during the run."""
    victim, other = on_one_decoder
    address = worker_status(cluster, victim).metrics_address
    preempted = _counter(address, 'pdserve_worker_preemptions_total{role=decode}')
    moved = _moved(cluster, "rebalance")
    futures, counts = _streams(cluster, [greedy_request(p, TOKENS) for p in CROWD])
    wait_until(lambda: min(counts) >= 1, 120.0, "every stream under way")
    if rebalance:
        _admin(cluster, other, undo=True)
    assert [f.result(timeout=300)[0] for f in futures] == reference["crowd"]
    preemptions = _counter(address, 'pdserve_worker_preemptions_total{role=decode}')
    return preemptions - preempted, _moved(cluster, "rebalance") - moved


@pytest.mark.parametrize("cluster", ["shared"], indirect=True)
def test_rebalancing_moves_requests_where_the_worker_alone_would_preempt(
        cluster, reference, on_one_decoder):
    alone, moved = _crowd(cluster, reference, on_one_decoder, rebalance=False)
    assert alone > 0 and moved == 0  # nowhere to go: it recomputed some
    _assert_no_leak(cluster)
    preempted, moved = _crowd(cluster, reference, on_one_decoder, rebalance=True)
    # Moves race the cache filling up: a slow heartbeat may still let one preemption through.
    assert moved > 0 and preempted < alone
    _assert_no_leak(cluster)
