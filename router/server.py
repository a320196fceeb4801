"""The router process: options, wiring, the dead-worker reaper, and serve-until-signal."""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.grpc_server import NO_DEADLINE_S, Server, start_server
from engine.config import ModelConfig
from engine.gc_heap import freeze_startup_heap, thaw_heap
from engine.prepare import default_model_dir, is_prepared
from engine.tokenizer import Tokenizer
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.fleet.admin_service import RouterAdminServicer
from router.fleet.registry import Role, WorkerRegistry
from router.fleet.registry_service import WorkerRegistryServicer
from router.frontdoor.grpc_api import GenerationServicer, add_generation_servicer
from router.frontdoor.http_api import HttpApi
from router.frontdoor.lenient import TRANSPORT_LIMIT_BYTES
from router.frontdoor.validation import Frontend
from router.metrics import RouterMetrics
from router.policy.admission import QUEUE_POLICIES, Admission
from router.policy.moves import MovePolicy, RebalanceConfig
from router.policy.placement import PlacementPolicy
from router.policy.prefill_site import PrefillSiteConfig, PrefillSitePolicy
from router.request.calls import DEFAULT_TIMEOUT_S
from router.request.move_trigger import MoveTrigger
from router.request.orchestrator import Orchestrator
from router.request.worker_client import WorkerStubs
from security import auth
from security.tls import ClusterTls, ServerTls

log = logging.getLogger(__name__)
SERVICE_NAMES = [pb.DESCRIPTOR.services_by_name[name].full_name
                 for name in ("Generation", "WorkerRegistry", "RouterAdmin")]
GENERATION_SERVICE = SERVICE_NAMES[0]
# Internal: only cluster members may register, and only they (an operator holding the cluster's
# credentials) may drain a worker.
INTERNAL_SERVICES = SERVICE_NAMES[1:]


@dataclass(frozen=True)
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    model: str = "default"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    lease_s: float = 30.0
    max_running: int = 256  # requests served at once
    max_queued: int = 1024  # requests waiting for a slot; beyond: RESOURCE_EXHAUSTED
    metrics_port: int = 0  # 0: any free port
    http_port: int = 8000  # the OpenAI-compatible HTTP API on `host` (0: off)
    grace_s: float = 30.0  # drain on SIGTERM
    default_timeout_s: float = DEFAULT_TIMEOUT_S  # a request whose client set no deadline
    cache_aware: bool = True  # placement counts what workers' prefix caches hold
    local_prefill: PrefillSiteConfig = PrefillSiteConfig()  # conditional disaggregation
    rebalance: RebalanceConfig = RebalanceConfig()  # running requests' KV off full workers
    queue_policy: str = "short_first"  # which queued request a freed slot goes to
    queue_age_bound_s: float = 4.0  # short_first: older than this goes first whatever its size
    # The cluster token (security.auth): workers must present it to register and heartbeat.
    cluster_token: str | None = field(default=None, repr=False)
    tls: ServerTls | None = None  # TLS on the gRPC and HTTP ports (workers then need the CA)
    insecure: bool = False  # plaintext beyond loopback is intended: no warning
    # Mutual TLS with the workers; they then register on `internal_port` (gRPC cannot ask only
    # some callers of one port for a certificate, and public clients have none).
    cluster_tls: ClusterTls | None = None
    internal_port: int | None = None  # the registry's own port (None: on the public port)

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 65535], got "
                                 f"{getattr(self, name)}")
        if self.max_running < 1 or self.max_queued < 0:
            raise ValueError(f"--max-running must be >= 1 and --max-queued >= 0, got "
                             f"{self.max_running} and {self.max_queued}")
        if not 0 < self.default_timeout_s < NO_DEADLINE_S:
            raise ValueError(f"--default-timeout-s must be in (0, {NO_DEADLINE_S:g}), got "
                             f"{self.default_timeout_s}")
        if not self.grace_s > 0:
            raise ValueError(f"--grace-s must be > 0, got {self.grace_s}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("heartbeat_interval_s must be > 0 and below heartbeat_timeout_s "
                             f"({self.heartbeat_interval_s} vs {self.heartbeat_timeout_s})")
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"--queue-policy must be one of {', '.join(QUEUE_POLICIES)}, got "
                             f"{self.queue_policy!r}")
        if not self.queue_age_bound_s > 0:
            raise ValueError(f"--queue-age-bound-s must be > 0, got {self.queue_age_bound_s}")
        if self.internal_port is not None and not 0 <= self.internal_port < 65536:
            raise ValueError(f"--internal-port must be in [0, 65535], got {self.internal_port}")
        if self.cluster_tls is not None and self.internal_port is None:
            raise ValueError("--cluster-cert needs --internal-port: workers register there over "
                             "mutual TLS, apart from the public port")


def model_dir(model: str) -> Path:
    """The tokenizer/config directory (the router never loads weights, so it never prepares)."""
    if model == "default":
        path = default_model_dir()
        if not is_prepared(path):
            raise FileNotFoundError(f"the default model is not prepared at {path}: run "
                                    "`python -m engine prepare-model` (scripts/setup.sh does)")
        return path
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r} is not a local model directory")
    return path


class Router:
    def __init__(self, options: RouterOptions):
        self.options = options
        path = model_dir(options.model)
        self.model_name = path.name
        self.registry = WorkerRegistry(options.heartbeat_timeout_s)
        self.placement = PlacementPolicy(self.registry, cache_aware=options.cache_aware)
        self.frontend = Frontend(Tokenizer(path), ModelConfig.from_dir(path), self.model_name)
        self.metrics = RouterMetrics()
        self.admission = Admission(options.max_running, options.max_queued,
                                   policy=options.queue_policy,
                                   age_bound_s=options.queue_age_bound_s)
        stubs = self.stubs = WorkerStubs()
        self.sites = PrefillSitePolicy(options.local_prefill)
        self.orchestrator = Orchestrator(self.placement, stubs, self.metrics, options.lease_s,
                                         sites=self.sites)
        self.moves = MoveTrigger(self.registry, self.orchestrator.streams,
                                 MovePolicy(options.rebalance), stubs, options.lease_s)
        self.metrics.watch(lambda: self.admission.queued, lambda: self.admission.running,
                           self._placeable_workers)
        self._stopped = threading.Event()
        self.server: Server | None = None
        self.internal_server: Server | None = None  # the registry, with --internal-port
        self.internal_address = ""
        self.generation: GenerationServicer | None = None
        self.http: HttpApi | None = None
        self.http_address = ""

    def _placeable_workers(self) -> dict[str, int]:
        return {role.value: len(self.registry.placeable(lambda r, role=role: r is role))
                for role in Role}

    def start(self) -> int:
        # Our calls to the workers carry the same credentials.
        auth.configure(self.options.cluster_token, self.options.cluster_tls)
        auth.warn_if_exposed("the router", self.options.host,
                             self.options.cluster_token or self.options.cluster_tls,
                             plaintext=self.options.tls is None and not self.options.insecure)
        metrics_port = self.metrics.serve(self.options.host, self.options.metrics_port)
        self.metrics_address = f"{self.options.host}:{metrics_port}"
        generation = GenerationServicer(self.frontend, self.orchestrator, self.placement,
                                        self.admission, self.metrics, self.metrics_address,
                                        self.options.default_timeout_s)
        self.generation = generation
        if self.options.http_port:
            self.http = HttpApi(generation, self.options.host, self.options.http_port,
                                self.options.tls.ssl_context() if self.options.tls else None)
            self.http_address = f"{self.options.host}:{self.http.start()}"
            generation.http_address = self.http_address
        self._serve_grpc(generation)
        threading.Thread(target=self._reap, name="reaper", daemon=True).start()
        self.moves.start()
        return self.server.port

    def _serve_grpc(self, generation: GenerationServicer) -> None:
        """The public port (Generation, and the registry unless it has its own port)."""
        registry = WorkerRegistryServicer(self.registry, self.model_name,
                                          self.options.heartbeat_interval_s)
        admin = RouterAdminServicer(self.registry, self.orchestrator.streams.count, self.sites)
        add_registry = [lambda s: pb_grpc.add_WorkerRegistryServicer_to_server(registry, s),
                        lambda s: pb_grpc.add_RouterAdminServicer_to_server(admin, s)]
        apart = self.options.internal_port is not None
        self.server = start_server(
            self.options.host, self.options.port,
            [lambda s: add_generation_servicer(generation, s), *([] if apart else add_registry)],
            [GENERATION_SERVICE] if apart else SERVICE_NAMES,
            max_receive_bytes=TRANSPORT_LIMIT_BYTES,
            internal=INTERNAL_SERVICES, on_refused=self.metrics.refused_unauthenticated,
            tls=self.options.tls,
            # Every running or queued stream holds a handler thread; the pool must not be what
            # limits them (gRPC would queue the excess silently instead of refusing it).
            max_workers=self.options.max_running + self.options.max_queued + 64)
        if apart:  # mutual TLS (with --cluster-cert), the token, or both
            self.internal_server = start_server(
                self.options.host, self.options.internal_port or 0, add_registry,
                INTERNAL_SERVICES, internal=INTERNAL_SERVICES,
                on_refused=self.metrics.refused_unauthenticated,
                # mutual TLS; else the public port's TLS: the token must not cross in clear
                tls=self.options.cluster_tls or self.options.tls)
            self.internal_address = f"{self.options.host}:{self.internal_server.port}"

    def drain(self) -> bool:
        """Refuse new requests (health NOT_SERVING), let in-flight ones finish within the
        grace period; True when all did."""
        assert self.server is not None and self.generation is not None
        self.generation.draining.set()
        self.server.set_serving(False)
        deadline = time.monotonic() + self.options.grace_s
        while not self.admission.idle() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.admission.idle()

    def _reap(self) -> None:
        while not self._stopped.wait(self.options.heartbeat_interval_s):
            for worker in self.registry.drop_dead():
                abandoned = self.orchestrator.lost.abandon(worker.worker_id)
                self.stubs.forget(worker.worker_id)
                self.metrics.workers_dropped.labels(worker.role.value).inc()
                self.metrics.calls_abandoned.inc(abandoned)
                log.warning("worker %s (%s) missed its heartbeats: dropped, %d calls in flight "
                            "to it abandoned", worker.worker_id, worker.address, abandoned)

    def stop(self, grace_s: float = 5.0) -> None:
        self._stopped.set()
        self.moves.stop()
        if self.http is not None:
            self.http.stop()
        if self.server is not None:
            self.server.stop(grace_s)
        if self.internal_server is not None:
            self.internal_server.stop(grace_s)


def serve(options: RouterOptions) -> int:
    router = Router(options)
    freeze_startup_heap()  # before it listens; the process routes until it exits
    try:
        return _serve_until_signal(router, options)
    finally:
        thaw_heap()


def _serve_until_signal(router: Router, options: RouterOptions) -> int:
    port = router.start()
    http = f", OpenAI API: http://{router.http_address}/v1" if router.http_address else ""
    if router.internal_address:
        http += f", workers register at {router.internal_address}"
    print(f"router serving on {options.host}:{port} "
          f"(metrics: http://{router.metrics_address}/metrics{http})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.2):  # see serving.worker_main._wait_for_signal
        pass
    if not router.drain():
        log.warning("drain: requests still in flight after %.0fs; stopping anyway",
                    options.grace_s)
    router.stop(1.0)
    return 0
