"""Prometheus metrics of a worker, served on its own /metrics HTTP endpoint.

Gauges are read from the loop's latest LoadSnapshot at scrape time (never from the engine, which
only the loop thread touches); latency histograms are fed from the loop's deliveries; counters
from the servicers. Each worker owns a CollectorRegistry, so tests can run several in a process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.engine import RequestOutput
from serving.loop import LoadSnapshot

# Seconds: from a few ms (one decode step of a tiny model) to minutes (a long queue on a CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


class LoadCollector(Collector):
    """Exports a worker's LoadSnapshot as gauges and its engine counters as counters."""

    def __init__(self, load: Callable[[], LoadSnapshot], role: str):
        self._load = load
        self._role = role

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = self._load()
        gauges = {
            "running_requests": ("Requests in the running batch", load.running_requests),
            "waiting_requests": ("Requests queued on the worker (its queue depth)",
                                 load.waiting_requests),
            "queued_prompt_tokens": ("Prompt tokens not yet computed", load.queued_prompt_tokens),
            "kv_blocks_free": ("KV blocks an allocation can take now", load.free_blocks),
            "kv_blocks_used": ("KV blocks held by requests",
                               load.total_blocks - load.free_blocks),
            "kv_blocks_total": ("KV blocks in the cache", load.total_blocks),
            "prefix_cache_hit_rate": ("Share of looked-up prompt tokens found in the prefix "
                                      "cache", load.prefix_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"pdserve_worker_{name}", doc, labels=["role"])
            family.add_metric([self._role], value)
            yield family
        counters = {
            "preemptions": ("Requests preempted (recomputed later) for lack of KV blocks",
                            load.preemptions),
            "prefix_cache_queries_tokens": ("Prompt tokens looked up in the prefix cache",
                                            load.prefix_query_tokens),
            "prefix_cache_hits_tokens": ("Prompt tokens found in the prefix cache",
                                         load.prefix_hit_tokens),
            "engine_steps": ("Engine steps run", load.steps),
        }
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(f"pdserve_worker_{name}", doc, labels=["role"])
            family.add_metric([self._role], value)
            yield family


class WorkerMetrics:
    def __init__(self, role: str, load: Callable[[], LoadSnapshot],
                 tensor_parallel_size: int = 1):
        self.role = role
        self.registry = CollectorRegistry()
        self.registry.register(LoadCollector(load, role))
        labels = ["role"]
        Gauge("pdserve_worker_tensor_parallel_size", "Ranks (processes, devices) the worker's "
              "model is split over", labels, registry=self.registry).labels(role).set(
                  tensor_parallel_size)
        self.ttft = Histogram("pdserve_worker_ttft_seconds", "Arrival on the worker to the first "
                              "token", labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdserve_worker_inter_token_latency_seconds", "Time between a "
                             "request's consecutive outputs", labels, registry=self.registry,
                             buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pdserve_worker_e2e_seconds", "A request's time on the worker, "
                             "arrival to finish", labels, registry=self.registry,
                             buckets=LATENCY_BUCKETS)
        self.rejections = Counter("pdserve_worker_rejections", "RPCs refused, by method and "
                                  "status code", ["role", "method", "code"],
                                  registry=self.registry)
        self.kv_transfer_bytes = Counter("pdserve_worker_kv_transfer_bytes", "KV bytes sent "
                                         "or received, by transport (shared, dist)",
                                         ["role", "direction", "transport"],
                                         registry=self.registry)
        self.kv_transfer_seconds = Counter("pdserve_worker_kv_transfer_seconds", "Seconds "
                                           "spent moving KV", ["role", "direction", "transport"],
                                           registry=self.registry)
        self.kv_streamed_bytes = Counter("pdserve_worker_kv_streamed_bytes", "KV bytes copied "
                                         "to decode workers while their prompt was still "
                                         "computing (shared transport)", ["role"],
                                         registry=self.registry)
        self.kv_transfer_failures = Counter("pdserve_worker_kv_transfer_failures", "KV "
                                            "transfers that failed", ["role", "direction",
                                                                      "transport"],
                                            registry=self.registry)
        self.kv_integrity_failures = Counter("pdserve_worker_kv_integrity_failures", "KV "
                                             "pieces refused because their bytes did not "
                                             "match their MAC (nothing written)",
                                             ["role", "transport"], registry=self.registry)
        self._last_output: dict[str, float] = {}
        self.http_port = 0

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint (port 0 picks a free one); return its port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        self.http_port = self._http.server_port
        return self.http_port

    def close(self) -> None:
        """Stop the /metrics endpoint and free its port."""
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()
            self._http = None

    def observe_output(self, output: RequestOutput) -> None:
        """Called on the loop thread for every output delivered to a request."""
        now = time.monotonic()
        rid = output.request_id
        last = self._last_output.get(rid)
        if last is not None:
            self.itl.labels(self.role).observe(now - last)
        elif output.ttft_s is not None:
            self.ttft.labels(self.role).observe(output.ttft_s)
        if output.finished:
            self._last_output.pop(rid, None)
            if output.latency_s is not None:
                self.e2e.labels(self.role).observe(output.latency_s)
        else:
            self._last_output[rid] = now

    def forget(self, request_id: str) -> None:
        """The request left without finishing (aborted, detached, failed)."""
        self._last_output.pop(request_id, None)

    def transfer(self, direction: str, num_bytes: int, seconds: float, transport: str) -> None:
        self.kv_transfer_bytes.labels(self.role, direction, transport).inc(num_bytes)
        self.kv_transfer_seconds.labels(self.role, direction, transport).inc(seconds)

    def streamed(self, num_bytes: int) -> None:
        self.kv_streamed_bytes.labels(self.role).inc(num_bytes)

    def transfer_failed(self, direction: str, transport: str) -> None:
        self.kv_transfer_failures.labels(self.role, direction, transport).inc()

    def integrity_failed(self, transport: str) -> None:
        self.kv_integrity_failures.labels(self.role, transport).inc()

    def reject(self, method: str, code: str) -> None:
        self.rejections.labels(self.role, method, code).inc()
