"""Prometheus metrics of the router, served on its /metrics HTTP endpoint. The servicer and the
orchestrator record events; queue depth and running requests are read from the admission queue
at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve_proto import pdserve_pb2 as pb

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


class QueueCollector(Collector):
    def __init__(self, queued: Callable[[], int], running: Callable[[], int],
                 workers: Callable[[], dict[str, int]]):
        self._queued = queued
        self._running = running
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("pdserve_router_queue_depth",
                                "Requests waiting in the router for a slot", value=self._queued())
        yield GaugeMetricFamily("pdserve_router_running_requests",
                                "Requests the router is serving", value=self._running())
        workers = GaugeMetricFamily("pdserve_router_workers", "Placeable workers by role",
                                    labels=["role"])
        for role, count in self._workers().items():
            workers.add_metric([role], count)
        yield workers


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("pdserve_router_ttft_seconds", "Arrival to the first token",
                              registry=self.registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdserve_router_inter_token_latency_seconds",
                             "Time between consecutive token messages of a stream",
                             registry=self.registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pdserve_router_e2e_seconds", "Arrival to the last token of a "
                             "finished request", registry=self.registry,
                             buckets=LATENCY_BUCKETS)
        self.requests = Counter("pdserve_router_requests", "Requests ended, by front door and "
                                "outcome (a gRPC code; HTTP statuses map to theirs)",
                                ["api", "code"], registry=self.registry)
        self.retries = Counter("pdserve_router_retries", "Prefill attempts retried on another "
                               "worker after a failure", registry=self.registry)
        self.migrations = Counter("pdserve_router_migrations", "Requests moved to another "
                                  "decode worker mid-stream", registry=self.registry)
        self.live_migrations = Counter("pdserve_router_live_migrations", "Running requests "
                                       "asked to move their KV to another decode worker, by "
                                       "cause (drain, operator, rebalance) and outcome (moved; "
                                       "resumed: nowhere to go; failed: recomputed instead)",
                                       ["cause", "outcome"], registry=self.registry)
        self.live_migration_bytes = Counter("pdserve_router_live_migration_bytes", "KV bytes "
                                            "moved between decode workers by live moves, by "
                                            "transport", ["transport"], registry=self.registry)
        self.live_migration_pause = Histogram("pdserve_router_live_migration_pause_seconds",
                                              "How long a stream stood still for a live move: "
                                              "its last token before the pause -> the first "
                                              "after it", registry=self.registry,
                                              buckets=LATENCY_BUCKETS)
        self.kv_transfer_bytes = Counter("pdserve_router_kv_transfer_bytes", "KV bytes moved "
                                         "from prefill to decode workers, by transport",
                                         ["transport"], registry=self.registry)
        self.kv_transfer_seconds = Counter("pdserve_router_kv_transfer_seconds", "Seconds "
                                           "spent moving KV, by transport", ["transport"],
                                           registry=self.registry)
        self.prefill_sites = Counter("pdserve_router_prefill_sites", "Where prompts of "
                                     "disaggregated requests were prefilled: remote (a prefill "
                                     "worker) or local (the decode worker), and why",
                                     ["site", "reason"], registry=self.registry)
        self.phases = Histogram("pdserve_router_request_phase_seconds", "Where a finished "
                                "request's time to first token went: router_queue, "
                                "prefill_queue, prefill_compute, kv_transfer (KV shipped), "
                                "decode_admission (KV shipped), ttft", ["phase"],
                                registry=self.registry, buckets=LATENCY_BUCKETS)
        self.auth_failures = Counter("pdserve_router_auth_failures", "Internal calls refused "
                                     "UNAUTHENTICATED (no or wrong cluster token), by method",
                                     ["method"], registry=self.registry)
        self.workers_dropped = Counter("pdserve_router_workers_dropped", "Workers dropped for "
                                       "missed heartbeats (dead, hung or cut off), by role",
                                       ["role"], registry=self.registry)
        self.calls_abandoned = Counter("pdserve_router_calls_abandoned", "Calls in flight to "
                                       "dropped workers, cancelled so their requests retry or "
                                       "migrate", registry=self.registry)
        self.http_port = 0

    def refused_unauthenticated(self, method: str) -> None:
        self.auth_failures.labels(method).inc()

    def observe_phases(self, timings: pb.Timings) -> None:
        phases = {"router_queue": timings.router_queue_s,
                  "prefill_queue": timings.prefill_queue_s,
                  "prefill_compute": timings.prefill_compute_s, "ttft": timings.ttft_s}
        if timings.kv_transfer_bytes:
            phases["kv_transfer"] = timings.kv_transfer_s
            phases["decode_admission"] = timings.decode_admission_s
        for phase, seconds in phases.items():
            self.phases.labels(phase).observe(max(0.0, seconds))

    def watch(self, queued: Callable[[], int], running: Callable[[], int],
              workers: Callable[[], dict[str, int]]) -> None:
        self.registry.register(QueueCollector(queued, running, workers))

    def serve(self, host: str, port: int) -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.http_port = server.server_port
        return self.http_port
