"""What the partition tests do from inside the router's namespace (the only place its address is
reachable from): these functions run in a process pool whose processes entered that namespace
at start (`init`), so they must be importable and take and return plain values."""

from __future__ import annotations

from pathlib import Path

from common.client import cluster_status
from pdserve_proto import pdserve_pb2 as pb
from tests.cluster import netns
from tests.cluster.cluster_helpers import greedy_request, scrape, stream_tokens


def init(namespace: str) -> None:
    netns.enter(namespace)


def workers(address: str) -> dict[str, dict]:
    """The router's view of its workers, by id."""
    status = cluster_status(address, 5.0, None)
    return {w.worker_id: {"role": pb.WorkerRole.Name(w.role), "healthy": w.healthy,
                          "free": w.free_blocks, "total": w.total_blocks,
                          "metrics": w.metrics_address} for w in status.workers}


def metrics(address: str) -> dict[str, float]:
    return scrape(address)


def metric(address: str, name: str) -> float:
    return scrape(address).get(name, 0.0)


def generate(address: str, ids: list[int], max_tokens: int, progress: str | None = None,
             timeout_s: float = 120.0) -> tuple[list[int], str]:
    """A streamed greedy generation: its tokens and finish reason. With `progress`, the count
    of tokens received so far is written to that file as they arrive."""
    tokens, _, last = stream_tokens(
        address, greedy_request(ids, max_tokens), timeout_s,
        progress=(lambda count: Path(progress).write_text(str(count))) if progress else None)
    return tokens, pb.FinishReason.Name(last.finish_reason)


def router_metric(address: str, name: str) -> float:
    """One sample of the router's own /metrics."""
    status = cluster_status(address, 5.0, None)
    return scrape(status.metrics_address).get(name, 0.0)
