"""Start a worker process: engine, step-loop thread, gRPC server, router link; stop on a signal."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from common.grpc_server import Server, start_server
from common.logs import configure_logging
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.gc_heap import freeze_startup_heap, thaw_heap
from engine.omp_threads import build_on_passing_thread, use_one_torch_thread
from engine.tp_ranks import RankLauncher
from kv_transfer.connectors import exports_cache
from kv_transfer.device import device_identity
from kv_transfer.selection import local_host_id
from pdserve_proto import pdserve_pb2 as pb
from security import auth
from security.tls import read_ca
from serving.gate import Gate
from serving.loop import EngineLoop
from serving.metrics import WorkerMetrics
from serving.options import WorkerOptions, parse_worker_args
from serving.router_link import ROLES, RouterLink, load_to_proto

log = logging.getLogger(__name__)


class RoleWorker(Protocol):
    """A role's policy object (PrefillWorker, DecodeWorker): what it offers the bootstrap.
    Names: a WorkerProcess runs one WorkerRole, whose `worker` is a RoleWorker; each role's
    role.py builds its WorkerRole."""

    loop: EngineLoop
    metrics: WorkerMetrics
    gate: Gate

    def in_flight(self) -> int: ...

    def close(self) -> None: ...


class WorkerRole:
    """A role as the bootstrap sees it: its worker, its gRPC services, where it hosts KV
    transfers, and (decode) what its KV receivers need to know once the server listens."""

    def __init__(self, worker: RoleWorker, service_names: list[str], transfer_host: str,
                 add_servicer: Callable[[grpc.Server], None],
                 bind: Callable[[str], None] = lambda address: None,
                 kv_receiver_id: Callable[[], str] = lambda: ""):
        self.worker = worker
        self.loop = worker.loop
        self.metrics = worker.metrics
        self.gate = worker.gate
        self.service_names = service_names
        self.transfer_host = transfer_host
        self.add_to_server = add_servicer
        self.bind = bind  # called with the gRPC server's address once it listens
        self.kv_receiver_id = kv_receiver_id  # decode: names this process's KV receivers

    def in_flight(self) -> int:
        return self.worker.in_flight()

    def close(self) -> None:
        self.worker.close()


def main(role_name: str, make_role: Callable[[LLMEngine, WorkerOptions], WorkerRole],
         argv: list[str] | None = None) -> int:
    """`python -m {role}_worker` for either role: parse, load the engine, serve."""
    options = parse_worker_args(role_name, argv)
    configure_logging(options.log_level, options.log_format)
    engine = build_engine(options)
    return serve(options, make_role(engine, options), engine.model_path.name)


def build_engine(options: WorkerOptions, rank_launcher: RankLauncher | None = None
                 ) -> LLMEngine:
    """The worker's engine (`rank_launcher`: where its tensor-parallel ranks 1.. run; default:
    local processes)."""
    import torch

    torch.set_num_threads(options.threads)  # workers share the machine's cores
    cache = CacheConfig(kv_cache_gb=options.kv_cache_gb, shareable=exports_kv_cache(options),
                        gpu_memory_fraction=options.gpu_memory_fraction)
    scheduler = SchedulerConfig.for_device(
        options.device, max_num_batched_tokens=options.step_budget,
        queue_policy=options.queue_policy, queue_age_bound_s=options.queue_age_bound_s,
        prefill_chunk_size=options.chunk_size,
        release_passed_blocks=options.role != "prefill")  # its prompts' blocks ship whole
    config = EngineConfig(model=options.model, dtype=options.dtype, cache=cache,
                          scheduler=scheduler, device=options.device,
                          cuda_graphs=options.cuda_graphs,
                          async_scheduling=options.async_scheduling,
                          tensor_parallel_size=options.tensor_parallel_size,
                          fused_kernels=options.fused_kernels)
    if options.device != "cpu":  # the GPU run proved workers built on this thread: kept so
        return LLMEngine(config, rank_launcher)
    # The engine loop's thread alone computes on `threads` cores (engine.omp_threads): this
    # thread goes on to serve requests, and the engine is built on one that ends.
    use_one_torch_thread()
    return build_on_passing_thread(lambda: LLMEngine(config, rank_launcher))


def exports_kv_cache(options: WorkerOptions) -> bool:
    """A decode worker that same-host prefill workers may write into (the shared transport)."""
    return options.role == "decode" and exports_cache(options.kv_transport)


def registration(options: WorkerOptions, role: WorkerRole, address: str,
                 metrics_address: str, model_name: str) -> pb.RegisterRequest:
    import torch

    engine = role.loop.engine
    return pb.RegisterRequest(
        worker_id=options.worker_id, role=ROLES[options.role], address=address,
        model=model_name, block_size=engine.block_manager.block_size,
        max_model_len=engine.max_model_len, kv_transfer_host=role.transfer_host,
        load=load_to_proto(role.loop.load), metrics_address=metrics_address,
        host_id=local_host_id(), kv_device=device_identity(torch.device(options.device)),
        kv_transport=options.kv_transport, kv_receiver_id=role.kv_receiver_id(),
        tensor_parallel_size=options.tensor_parallel_size,
        kv_layout=engine.runner.kv_shards.layout_text(),
        prefill_chunk_tokens=engine.scheduler.config.chunk_limit)


class WorkerProcess:
    """A started worker: step loop, gRPC server, /metrics and router link, registered. The CLI
    runs it until a signal; a Ray actor (deploy/) runs the same object in its process."""

    def __init__(self, options: WorkerOptions, role: WorkerRole, model_name: str,
                 stop: threading.Event | None = None):
        """`stop`: set by a signal; registration gives up when it is (InterruptedError)."""
        self.options, self.role = options, role
        self.server: Server | None = None
        self.link: RouterLink | None = None
        try:
            auth.configure(options.cluster_token, options.cluster_tls)
            auth.warn_if_exposed(f"worker {options.worker_id}", options.host,
                                 options.cluster_token or options.cluster_tls)
            role.loop.start()
            self.server = start_server(
                options.host, options.port, [role.add_to_server], role.service_names,
                internal=role.service_names, tls=options.cluster_tls,
                on_refused=lambda method: role.metrics.reject(method, "UNAUTHENTICATED"))
            self.address = f"{options.public_host}:{self.server.port}"
            role.bind(self.address)
            metrics_port = role.metrics.serve(options.host, options.metrics_port)
            self.metrics_address = f"{options.public_host}:{metrics_port}"
            # Before the router knows this worker: no request is in flight yet, and the process
            # serves with this engine until it exits (engine.gc_heap)
            freeze_startup_heap()
            self.link = RouterLink(options.router, registration(
                options, role, self.address, self.metrics_address, model_name),
                lambda: role.loop.load, read_ca(options.tls_ca))
            self.link.register(options.connect_timeout_s, stop)
        except BaseException:  # nothing started is left running
            self.close()
            raise
        self.link.start()

    def run_until(self, stop: threading.Event) -> None:
        """Serve until `stop` is set, then drain."""
        _wait_for_signal(stop)
        self.drain()

    def drain(self) -> None:
        assert self.server is not None and self.link is not None
        drain(self.role, self.server, self.link, self.options.grace_s)

    def close(self) -> None:
        log.info("worker %s stopping", self.options.worker_id)
        if self.link is not None:
            self.link.stop()
        if self.server is not None:
            self.server.stop(1.0)
        self.role.metrics.close()
        self.role.loop.stop()
        self.role.close()
        thaw_heap()


def serve(options: WorkerOptions, role: WorkerRole, model_name: str,
          stop: threading.Event | None = None) -> int:
    """Run until SIGINT/SIGTERM (or `stop` is set), drain, and return the exit code."""
    stop = stop or threading.Event()
    _install_signal_handlers(stop)
    role.loop.on_fatal = lambda reason: stop.set()  # e.g. a tensor-parallel rank died
    try:
        worker = WorkerProcess(options, role, model_name, stop)  # (the loop starts in here)
    except InterruptedError as exc:  # a signal while it registered: it stopped cleanly
        print(f"{options.role} worker {options.worker_id}: {exc}", flush=True)
        return 0
    try:
        print(f"{options.role} worker {options.worker_id} serving on {worker.address} "
              f"(metrics: http://{worker.metrics_address}/metrics)", flush=True)
        worker.run_until(stop)
    finally:
        worker.close()
    return 1 if role.loop.fatal else 0


def drain(role: WorkerRole, server: Server, link: RouterLink, grace_s: float) -> None:
    """Stop taking new requests (health NOT_SERVING, the router told at once), then let the
    accepted ones finish — their KV transfers and streams still run — for at most `grace_s`."""
    log.info("draining: no new requests; waiting up to %.0fs for accepted ones", grace_s)
    role.gate.draining.set()
    server.set_serving(False)
    link.drain()
    deadline = time.monotonic() + grace_s
    left = role.in_flight()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = role.in_flight()
    if left:
        log.warning("drain: %d requests still in flight after %.0fs; stopping anyway", left,
                    grace_s)
    else:
        log.info("drain: every accepted request finished")


def _wait_for_signal(stop: threading.Event) -> None:
    # A signal delivered to one of the other threads (gRPC, gloo, torch) does not interrupt the
    # main thread's blocking wait, and Python runs handlers only on the main thread: wake up
    # regularly so a SIGTERM is acted on at once rather than at the next signal.
    while not stop.wait(0.2):
        pass


def _install_signal_handlers(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
