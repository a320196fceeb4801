"""Shared pieces of the cluster tests: a local cluster per module, streaming clients, and the
offline engine's reference outputs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from common.grpc_server import channel
from launch.cluster import ClusterSpec, LocalCluster
from loadtest.workloads import ONLINE_MIXED
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the engine (torch) is imported only where a reference is computed
    from engine.engine import RequestOutput
    from engine.request import SamplingParams

KV_CACHE_GB = 0.25  # per worker: plenty for the tests, small enough for 4 workers on 24 GiB
MAX_TOKENS = 12


def long_prompt(min_tokens: int = 1400, rank: int = 0) -> list[int]:
    """The workload's longest prompt (rank 0), or the next longest with a different start."""
    rows = [json.loads(line) for line in ONLINE_MIXED.open()]
    rows.sort(key=lambda r: len(r["prompt_token_ids"]), reverse=True)
    chosen: list[list[int]] = []
    for row in rows:
        ids = row["prompt_token_ids"]
        if all(ids[:16] != other[:16] for other in chosen):
            chosen.append(ids)
        if len(chosen) > rank:
            break
    assert len(chosen[rank]) >= min_tokens
    return chosen[rank]


def start_cluster(tmp_path: Path, **spec: object) -> LocalCluster:
    spec.setdefault("kv_cache_gb", KV_CACHE_GB)
    return LocalCluster(ClusterSpec(port=0, ready_timeout_s=240.0, **spec),
                        log_dir=tmp_path / "logs").start()


def greedy_request(ids: list[int], max_tokens: int = MAX_TOKENS, rid: str = ""
                   ) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingOptions(max_tokens=max_tokens, temperature=0,
                                                          ignore_eos=True))


def stream_tokens(address: str, request: pb.GenerateRequest, timeout_s: float = 180.0,
                  root_ca: bytes | None = None, progress: Callable[[int], None] | None = None
                  ) -> tuple[list[int], str, pb.GenerateResponse]:
    """Token ids, text and the last message of one streamed generation (over TLS, trusting
    `root_ca`, when given); `progress` hears the count of tokens received after each message."""
    with channel(address, root_ca) as ch:
        tokens: list[int] = []
        text = ""
        last = None
        for part in pb_grpc.GenerationStub(ch).Generate(request, timeout=timeout_s):
            tokens.extend(part.token_ids)
            text += part.text
            last = part
            if progress is not None:
                progress(len(tokens))
        return tokens, text, last


def stream_all(address: str, prompts: list[list[int]], concurrency: int = 16,
               root_ca: bytes | None = None) -> list[list[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(stream_tokens, address, greedy_request(p, rid=f"t{i}"),
                               root_ca=root_ca) for i, p in enumerate(prompts)]
        return [f.result()[0] for f in futures]


def secure_spec(tmp: Path) -> dict[str, str]:
    """Secure mode for start_cluster: a cluster token, TLS on the router's public ports and
    mutual TLS between every process, from a throwaway CA."""
    from security.auth import new_token
    from security.certs import make_certs

    certs = make_certs(tmp / "certs")
    token = tmp / "cluster.token"
    token.write_text(new_token())
    token.chmod(0o600)
    return {"cluster_token_file": str(token), "tls_cert": str(certs["server.pem"]),
            "tls_key": str(certs["server.key"]), "tls_ca": str(certs["ca.pem"]),
            "cluster_cert": str(certs["server.pem"]), "cluster_key": str(certs["server.key"]),
            "cluster_ca": str(certs["ca.pem"])}


def router_ca(cluster: LocalCluster) -> bytes | None:
    """The CA a client of this cluster's router trusts (None: plaintext)."""
    return Path(cluster.spec.tls_ca).read_bytes() if cluster.spec.tls_ca else None


def wait_blocks_free(cluster: LocalCluster, timeout_s: float = 60.0) -> list[pb.WorkerStatus]:
    """Wait until every worker reports all its KV blocks free (heartbeats lag a little, and an
    aborted prefill chunk frees its blocks only when its step ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = list(cluster.status().workers)
        if all(w.free_blocks == w.total_blocks > 0 for w in workers) or \
                time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


def rpc_error(fn, *args) -> grpc.RpcError:  # noqa: ANN001 - any callable
    try:
        fn(*args)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("expected an RpcError")


class LoadWatcher:
    """Polls cluster status in the background; records each worker's peak running requests."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.max_running: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            try:
                for w in self.cluster.status().workers:
                    peak = max(self.max_running.get(w.worker_id, 0), w.running_requests)
                    self.max_running[w.worker_id] = peak
            except grpc.RpcError:
                pass

    def __enter__(self) -> LoadWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)


def scrape(address: str) -> dict[str, float]:
    """Every sample of a /metrics endpoint, keyed by name{labels} (labels sorted)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def worker_status(cluster: LocalCluster, worker_id: str) -> pb.WorkerStatus | None:
    return next((w for w in cluster.status().workers if w.worker_id == worker_id), None)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def offline_outputs(prompts: list[list[int]], params: list[SamplingParams]
                    ) -> list[RequestOutput]:
    """The offline engine's outputs (float32), prompt i under params[i], all from one engine
    (each load of the model costs seconds). Call it before the cluster starts, so the model is
    not loaded twice at once."""
    from engine.llm import LLM

    llm = LLM("default", dtype="float32")
    outputs = llm.generate(prompts, params)
    del llm
    return outputs


def greedy_params(max_tokens: int) -> SamplingParams:
    from engine.request import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def offline_greedy(prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    """The offline engine's greedy tokens (float32, EOS ignored): what the cluster must match."""
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    return [o.token_ids for o in offline_outputs(prompts, [greedy_params(n) for n in lengths])]
