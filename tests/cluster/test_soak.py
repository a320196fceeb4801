"""A bounded soak of a 1P+2D cluster: 1,000 streamed requests from 32 clients, 10% cancelled by
their client after the first token, one decode worker SIGKILLed a third of the way in. Every
request must end completed with the offline engine's greedy tokens, or cancelled by its client;
the survivors must hold no KV block afterwards."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.grpc_server import channel
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from tests.cluster.cluster_helpers import (
    greedy_request,
    offline_greedy,
    scrape,
    start_cluster,
    wait_blocks_free,
)
from tests.conftest import mixed_prompts

pytestmark = pytest.mark.slow
REQUESTS, CLIENTS, CANCEL_SHARE, KILL_AFTER = 1000, 32, 0.10, 330
PROMPT_TOKENS, MAX_TOKENS = 24, 4


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    return [p[:PROMPT_TOKENS] for p in mixed_prompts(workload_prompts, 40)]


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    return offline_greedy(prompts, MAX_TOKENS)


class Soak:
    def __init__(self, address: str, prompts: list[list[int]], reference: list[list[int]]):
        self.prompts = prompts
        self.reference = reference
        self.channel = channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[int] = []
        self.failures: list[str] = []
        self.done = 0
        self._lock = threading.Lock()

    def one(self, i: int, cancel: bool) -> None:
        which = i % len(self.prompts)
        call = self.stub.Generate(greedy_request(self.prompts[which], MAX_TOKENS, f"soak-{i}"),
                                  timeout=300)
        tokens: list[int] = []
        try:
            for part in call:
                tokens.extend(part.token_ids)
                if cancel:
                    call.cancel()
            outcome = "completed"
        except grpc.RpcError as exc:
            outcome = exc.code().name
            if exc.code() is not grpc.StatusCode.CANCELLED or not cancel:
                self.failures.append(f"{i}: {exc.code().name}: {exc.details()}")
        with self._lock:
            self.outcomes[outcome] += 1
            self.done += 1
            if outcome == "completed" and tokens != self.reference[which]:
                self.wrong.append(i)


def test_soak_1000_requests_with_cancels_and_a_decode_worker_killed(tmp_path, prompts,
                                                                      reference):
    rng = random.Random(0)
    cancels = set(rng.sample(range(REQUESTS), int(REQUESTS * CANCEL_SHARE)))
    with start_cluster(tmp_path, prefill=1, decode=2, dtype="float32") as cluster:
        soak = Soak(cluster.address, prompts, reference)
        start = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(soak.one, i, i in cancels) for i in range(REQUESTS)]
            while soak.done < KILL_AFTER:
                time.sleep(0.05)
            cluster.signal("decode-1", signal.SIGKILL)
            killed_at = soak.done
            for future in futures:
                future.result()
        seconds = time.monotonic() - start
        router = scrape(cluster.status().metrics_address)
        workers = wait_blocks_free(cluster)
        soak.channel.close()
    print(f"\nsoak: {REQUESTS} requests in {seconds:.0f}s ({REQUESTS / seconds:.1f} req/s), "
          f"decode-1 killed after {killed_at}; outcomes {dict(soak.outcomes)}; migrations "
          f"{router.get('pdserve_router_migrations_total{}', 0):.0f}, retries "
          f"{router.get('pdserve_router_retries_total{}', 0):.0f}")
    assert not soak.failures, soak.failures[:5]
    assert not soak.wrong, f"{len(soak.wrong)} completed requests differ from the reference"
    assert sum(soak.outcomes.values()) == REQUESTS
    assert soak.outcomes["completed"] >= REQUESTS - len(cancels)
    assert [w.worker_id for w in workers] == ["decode-0", "prefill-0"]
    assert all(w.free_blocks == w.total_blocks for w in workers), workers
