"""The shared transport's one-sided writes under faults, against one cluster whose first prefill
worker pauses inside every write (fault injection: PDSERVE_FAULT_KV_WRITE_PAUSE_S), so each race
happens at a known moment: a deadline aborting the request mid-write, the writer SIGKILLed
mid-write, the decode worker SIGKILLed while a prefill worker has its cache mapped. No block may be
handed back while a write may still land in it, none may leak, and the cluster keeps serving with
greedy output equal to the offline engine's."""

from __future__ import annotations

import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest
import torch

from tests.cluster.cluster_helpers import (
    greedy_request,
    offline_greedy,
    rpc_error,
    start_cluster,
    stream_tokens,
    wait_blocks_free,
    wait_until,
    worker_status,
)

pytestmark = pytest.mark.slow
PAUSE_S = 8.0  # prefill-0 holds each write open this long
PROMPTS = {"aborted": list(range(2000, 2100)), "killed": list(range(3000, 3150)),
           "after": list(range(4000, 4060))}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    names = list(PROMPTS)
    outputs = offline_greedy([PROMPTS[n] for n in names], MAX_TOKENS)
    return dict(zip(names, outputs))


CUDA = [pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


# On CPU the writes go through shared memory; on one GPU through CUDA IPC (the same rules).
@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=CUDA)])
def cluster(request, tmp_path_factory, reference):
    device = request.param
    # one GPU for all: the killed writer's replacement needs room beside the first two
    gpus = {"gpus": 1, "gpu_memory_fraction": 0.3} if device == "cuda" else {}
    patch = pytest.MonkeyPatch()
    patch.setenv("PDSERVE_FAULT_KV_WRITE_PAUSE_S", str(PAUSE_S))  # workers started now only
    try:
        running = start_cluster(tmp_path_factory.mktemp(f"shared-faults-{device}"), prefill=1,
                                decode=1, dtype="float32", device=device, **gpus,
                                router_args=("--heartbeat-timeout-s", "3",
                                             "--local-prefill", "off"))  # every KV is written
    finally:
        patch.undo()
    with running:
        yield running


def pauses(cluster, name: str) -> int:
    return (cluster.log_dir / f"{name}.log").read_text().count("pausing")


def held_blocks(cluster, worker_id: str) -> int:
    status = worker_status(cluster, worker_id)
    return status.total_blocks - status.free_blocks


def test_a_deadline_mid_write_frees_the_blocks_only_after_the_write(cluster):
    before = pauses(cluster, "prefill-0")
    error = rpc_error(stream_tokens, cluster.address,
                      greedy_request(PROMPTS["aborted"], MAX_TOKENS), 3.0)
    assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert pauses(cluster, "prefill-0") == before + 1, "the request never reached its write"
    # The router has aborted it on both workers, but prefill-0 may still write: the decode
    # worker keeps the reserved blocks until the write ends.
    time.sleep(1.0)  # > one heartbeat, < the rest of the pause
    assert held_blocks(cluster, "decode-0") > 0, "blocks freed under an in-flight write"
    workers = wait_blocks_free(cluster, timeout_s=PAUSE_S + 15)
    assert all(w.free_blocks == w.total_blocks for w in workers), workers


def test_a_writer_killed_mid_write_is_retried_and_leaks_nothing(cluster, reference):
    cluster.spawn_worker("prefill")  # prefill-1: started without the pause
    cluster.wait_workers(3, 120)
    before = pauses(cluster, "prefill-0")
    with ThreadPoolExecutor(1) as pool:
        # Both prefill workers are idle: ties go to prefill-0, which pauses in the write.
        result: Future = pool.submit(stream_tokens, cluster.address,
                                     greedy_request(PROMPTS["killed"], MAX_TOKENS))
        wait_until(lambda: pauses(cluster, "prefill-0") > before, 60, "prefill-0's write")
        assert held_blocks(cluster, "decode-0") > 0
        cluster.signal("prefill-0", signal.SIGKILL)
        tokens = result.result(timeout=120)[0]
    assert tokens == reference["killed"]
    wait_until(lambda: worker_status(cluster, "prefill-0") is None, 15, "prefill-0 to leave")
    workers = wait_blocks_free(cluster)
    assert all(w.free_blocks == w.total_blocks for w in workers), workers


def test_a_decode_worker_killed_while_mapped_leaves_the_cluster_serving(cluster, reference):
    # prefill-1 mapped decode-0's cache for the retried request above.
    cluster.spawn_worker("decode")
    cluster.wait_workers(3, 120)
    cluster.signal("decode-0", signal.SIGKILL)
    for _ in range(3):  # placed on decode-0 until the router notices: retried on decode-1
        tokens, _, last = stream_tokens(cluster.address,
                                        greedy_request(PROMPTS["after"], MAX_TOKENS))
        assert tokens == reference["after"]
        assert last.timings.kv_transport == "shared"
    wait_until(lambda: worker_status(cluster, "decode-0") is None, 15, "decode-0 to leave")
    workers = wait_blocks_free(cluster)
    assert {w.worker_id for w in workers} == {"prefill-1", "decode-1"}
    assert all(w.free_blocks == w.total_blocks for w in workers), workers
