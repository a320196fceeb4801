"""What the autoscaler reads each interval: the router's Prometheus metrics (TTFT and inter-token
histograms, requests ended) as differences since the last read, and its cluster status (queue,
workers, KV use, prefill backlog) averaged over the samples taken during the interval (one
reading of KV use swings with every request that starts or ends). No ray: the percentiles are
plain functions of bucket counts."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from common.client import cluster_status
from deploy.scaling import Signals
from loadtest.slo import SLO
from pdserve_proto import pdserve_pb2 as pb

TTFT = "pdserve_router_ttft_seconds"
ITL = "pdserve_router_inter_token_latency_seconds"
PHASES = "pdserve_router_request_phase_seconds"
# Time before a prompt's compute starts: in the router's queue, then on a prefill worker
QUEUES = ("router_queue", "prefill_queue")
REQUESTS = "pdserve_router_requests_total"
ROLE_NAMES = {pb.WORKER_ROLE_PREFILL: "prefill", pb.WORKER_ROLE_DECODE: "decode"}

Counts = dict[str, dict[float, float]]  # histogram -> upper bound -> cumulative count


def parse_metrics(text: str) -> tuple[Counts, float]:
    """The TTFT, ITL and queueing phases' cumulative histogram buckets, and the requests ended
    so far."""
    buckets: Counts = {TTFT: {}, ITL: {}, **{phase: {} for phase in QUEUES}}
    ended = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_bucket")
            if name == PHASES and sample.labels.get("phase") in QUEUES:
                name = sample.labels["phase"]
            if sample.name.endswith("_bucket") and name in buckets:
                buckets[name][float(sample.labels["le"])] = sample.value
            elif sample.name == REQUESTS:
                ended += sample.value
    return buckets, ended


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative `buckets` (upper bound -> count): linear
    within the bucket the rank falls in; None when empty; the last finite bound past it."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def _delta(now: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    """The counts added since `before` (all of `now` when the histogram started over)."""
    if now.get(float("inf"), 0.0) < before.get(float("inf"), 0.0):
        return dict(now)
    return {bound: count - before.get(bound, 0.0) for bound, count in now.items()}


class RouterSignals:
    def __init__(self, router_address: str, metrics_address: str, slo: SLO,
                 root_ca: bytes | None = None, clock: Callable[[], float] = time.monotonic):
        self.router_address = router_address
        self.metrics_address = metrics_address
        self.slo = slo
        self.root_ca = root_ca
        self._clock = clock
        self._last: tuple[float, Counts, float] | None = None
        self._samples: list[dict[str, Any]] = []

    def sample(self, timeout_s: float = 5.0) -> None:
        """Take one look at the cluster status (the next `read` averages them)."""
        self._samples.append(cluster_now(cluster_status(self.router_address, timeout_s,
                                                         self.root_ca)))

    def read(self, timeout_s: float = 5.0) -> Signals:
        """The interval since the last read. The first read only sets the baseline (its
        percentiles would cover the router's whole life): no latencies, no rate."""
        samples, self._samples = self._samples, []  # a failed read leaves no stale ones
        url = f"http://{self.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            buckets, ended = parse_metrics(reply.read().decode())
        samples.append(cluster_now(cluster_status(self.router_address, timeout_s,
                                                  self.root_ca)))
        now = self._clock()
        last, self._last = self._last, (now, buckets, ended)
        then, before, ended_before = last if last is not None else (now, buckets, ended)
        if ended < ended_before:  # the router restarted: its counters began again
            before, ended_before = {}, 0.0
        window = {name: _delta(counts, before.get(name, {})) for name, counts in buckets.items()}
        at = self.slo.ttft.percentile / 100
        queues = [quantile(at, window[phase]) for phase in QUEUES]
        return Signals(
            queue_ms=_ms(sum(q or 0.0 for q in queues)) if any(q is not None for q in queues)
            else None,
            ttft_ms=_ms(quantile(self.slo.ttft.percentile / 100, window[TTFT])),
            itl_ms=_ms(quantile(self.slo.itl.percentile / 100, window[ITL])),
            request_rate=(ended - ended_before) / (now - then) if now > then else 0.0,
            **averaged(samples))


def averaged(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Queue, backlog and KV use averaged over the samples; workers as the last one saw."""
    last = samples[-1]
    return {**last, "queued": round(sum(s["queued"] for s in samples) / len(samples)),
            "prefill_backlog_tokens": round(sum(s["prefill_backlog_tokens"] for s in samples)
                                            / len(samples)),
            "kv_use": sum(s["kv_use"] for s in samples) / len(samples)}


def cluster_now(status: pb.ClusterStatus) -> dict[str, Any]:
    """The Signals fields that come from the router's cluster status."""
    taking = [w for w in status.workers if w.healthy and not w.draining]
    decoders = [w for w in taking if w.role == pb.WORKER_ROLE_DECODE and w.total_blocks]
    workers = {role: sum(w.role == code for w in taking) for code, role in ROLE_NAMES.items()}
    return {"queued": status.queued_requests,
            "prefill_backlog_tokens": sum(w.queued_prompt_tokens for w in taking
                                          if w.role == pb.WORKER_ROLE_PREFILL),
            "kv_use": sum(1 - w.free_blocks / w.total_blocks for w in decoders)
            / len(decoders) if decoders else 0.0,
            "workers": workers,
            "registered": frozenset(w.worker_id for w in status.workers)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
