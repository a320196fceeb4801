"""Start a whole cluster on this machine: router + P prefill + D decode workers (or C colocated
workers), each its own process; wait until every worker is registered and healthy; stop them all
cleanly. Used by `python -m router launch` and by the cluster tests."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.client import cluster_status
from common.grpc_server import wait_healthy
from common.logs import check_logging
from launch.gpus import (
    MAX_FRACTION_PER_GPU,
    GpuSlot,
    assign_gpus,
    place_worker,
    planned_per_gpu,
    visible_gpus,
)
from pdserve_proto import pdserve_pb2 as pb
from security.tls import read_ca

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port
    threads: int = 1  # torch threads per worker
    dtype: str | None = None
    kv_cache_gb: float | None = None
    ready_timeout_s: float = 300.0
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    http_port: int | None = None  # the router's OpenAI HTTP API (None: any free port; 0: off)
    cluster_token_file: str | None = None  # passed to every process (security.auth)
    # TLS on the router's ports (gRPC and HTTP); the workers and this launcher trust tls_ca.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # Mutual TLS between every process (all three or none); the workers then register on a
    # port of the router's own, apart from the public one.
    cluster_cert: str | None = None
    cluster_key: str | None = None
    cluster_ca: str | None = None
    device: str = "cpu"  # cpu, or cuda: the workers spread over the GPUs (launch.gpus)
    gpus: int | None = None  # cuda: GPUs to use, cuda:0..N-1 (None: every visible GPU)
    gpu_memory_fraction: float | None = None  # per worker (None: 0.9 / workers on its GPU)
    kv_transport: str = "auto"  # auto | shared | dist, passed to every worker
    # The GPU speed paths, passed to every worker (None: the workers' default, on for CUDA).
    cuda_graphs: bool | None = None  # cuda: every worker replays decode steps from CUDA graphs
    async_scheduling: bool | None = None  # decode and colocated workers schedule step N+1 early
    fused_kernels: bool | None = None  # cuda: fused Triton element-wise kernels in every worker
    max_num_batched_tokens: int | None = None  # every worker's step budget (None: its default)
    tensor_parallel_size: int = 1  # ranks per worker (engine.tensor_parallel), every role
    prefill_tp: int | None = None  # prefill workers' ranks (None: tensor_parallel_size)
    decode_tp: int | None = None  # decode workers' ranks (None: tensor_parallel_size)
    log_level: str = "info"  # every process's --log-level
    log_format: str = "text"  # every process's --log-format (text | json)

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.colocated == 0 and (self.prefill < 1 or self.decode < 1):
            raise ValueError("need >= 1 prefill and >= 1 decode worker, or --colocated N")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("colocated mode runs colocated workers only (set prefill=decode=0)")
        if len({bool(self.cluster_cert), bool(self.cluster_key), bool(self.cluster_ca)}) > 1:
            raise ValueError("--cluster-cert, --cluster-key and --cluster-ca go together")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        for flag, on in (("--cuda-graphs", self.cuda_graphs),
                         ("--fused-kernels", self.fused_kernels)):
            if on and self.device != "cuda":
                raise ValueError(f"{flag} needs --device cuda")
        self._check_tensor_parallel()
        self._check_numbers()
        check_logging(self.log_level, self.log_format)
        if self.kv_transport not in ("auto", "shared", "dist"):
            raise ValueError(f"--kv-transport must be auto, shared or dist, got "
                             f"{self.kv_transport!r}")
        if self.device == "cpu" and (self.gpus is not None
                                     or self.gpu_memory_fraction is not None):
            raise ValueError("--gpus and --gpu-memory-fraction need --device cuda")
        if self.gpus is not None and self.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {self.gpus}")
        fraction = self.gpu_memory_fraction
        if fraction is not None and not 0 < fraction <= MAX_FRACTION_PER_GPU:
            raise ValueError(f"--gpu-memory-fraction must be in (0, {MAX_FRACTION_PER_GPU}], "
                             f"got {fraction}")
        if self.gpus is not None:
            self.check_gpus(self.gpus)

    def _check_numbers(self) -> None:
        """What every worker or the router would refuse, refused before anything starts."""
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"--kv-cache-gb must be > 0, got {self.kv_cache_gb}")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"--http-port and --port must differ, both {self.port}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")

    def _check_tensor_parallel(self) -> None:
        for flag, size in (("--tensor-parallel-size", self.tensor_parallel_size),
                           ("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp)):
            if size is not None and size < 1:
                raise ValueError(f"{flag} must be >= 1, got {size}")
        if self.device == "cuda" and max(self.tp_for(r) for r in ("prefill", "decode")) > 1:
            raise ValueError("tensor parallelism (--tensor-parallel-size, --prefill-tp, "
                             "--decode-tp > 1) runs on CPU ranks so far: its GPU path is unproven")
        if self.colocated and (self.prefill_tp or self.decode_tp):
            raise ValueError("--prefill-tp and --decode-tp are for prefill and decode workers; "
                             "colocated workers take --tensor-parallel-size")

    def tp_for(self, role: str) -> int:
        """Ranks per worker of `role` (prefill, decode or colocated)."""
        size = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return size or self.tensor_parallel_size

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    def check_gpus(self, num_gpus: int) -> None:
        """The workers fit on `num_gpus` GPUs (raises ValueError naming the flag otherwise)."""
        sharing = max(planned_per_gpu(self.num_workers, num_gpus))
        fraction = self.gpu_memory_fraction
        if fraction is not None and sharing * fraction > MAX_FRACTION_PER_GPU + 1e-9:
            raise ValueError(f"--gpu-memory-fraction {fraction:g} x {sharing} workers on one GPU "
                             f"= {sharing * fraction:.2f}: the workers on one GPU may use at most "
                             f"{MAX_FRACTION_PER_GPU} of it together ({self.num_workers} workers "
                             f"on {num_gpus} GPUs)")
        if self.kv_transport == "dist" and not self.colocated and sharing > 1:
            raise ValueError(f"--kv-transport dist needs one GPU per worker ({self.num_workers} "
                             f"workers on {num_gpus} GPUs): NCCL cannot put two ranks on one "
                             f"GPU; use --kv-transport auto or shared")
        assign_gpus(self.num_workers, num_gpus, fraction)  # e.g. too many workers on one GPU


# Starts of a cluster whose router exits during start (its port taken meanwhile), and how long
# a start waits for the router's health check.
START_ATTEMPTS = 3
ROUTER_START_TIMEOUT_S = 60.0


class RouterExited(RuntimeError):
    """The router process exited before it answered its health check."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    spec: ClusterSpec
    log_dir: Path | None = None
    address: str = ""
    registry_address: str = ""  # where workers register (the router's internal port, or address)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    signalled: set[str] = field(default_factory=set)  # processes meant to exit
    gpu_slots: dict[str, GpuSlot] = field(default_factory=dict)  # worker name -> its GPU (cuda)
    num_gpus: int | None = None  # cuda: resolved from spec.gpus or the visible GPUs

    def start(self) -> LocalCluster:
        if self.processes:
            raise RuntimeError("this cluster is already started")
        self.resolve_gpus()  # a cluster that cannot fit fails before anything starts
        # A port free_port found free can be taken before the router binds it (another process
        # on the machine, e.g. a parallel test's): with ports of our own choosing, a router that
        # exits during start is started again on fresh ones.
        attempts = 1 if self.spec.port else START_ATTEMPTS
        for attempt in range(1, attempts + 1):
            try:
                self._start_once()
                return self
            except RouterExited:
                self.stop()
                if attempt == attempts:
                    raise
                self.processes.clear()
                self.signalled.clear()
            except BaseException:
                self.stop()
                raise
        return self

    def _start_once(self) -> None:
        port = self.spec.port or free_port(self.spec.host)
        self.address = self.registry_address = f"{self.spec.host}:{port}"
        internal = []
        if self.spec.cluster_cert:
            internal_port = free_port(self.spec.host)
            self.registry_address = f"{self.spec.host}:{internal_port}"
            internal = ["--internal-port", str(internal_port)]
        http_port = self.spec.http_port
        if http_port is None:
            http_port = free_port(self.spec.host)
        self._spawn("router", ["router", "serve", "--host", self.spec.host, "--port",
                               str(port), "--model", self.spec.model, "--http-port",
                               str(http_port), *internal, *self._token_args(),
                               *self._tls_args(True), *self._log_args(),
                               *self.spec.router_args])
        # The workers start beside the router, not after it: each loads its model while the
        # router starts and retries its registration until the router answers.
        roles = (["prefill"] * self.spec.prefill + ["decode"] * self.spec.decode
                 + ["colocated"] * self.spec.colocated)
        for role in roles:
            self.spawn_worker(role)
        self._wait_router(ROUTER_START_TIMEOUT_S)
        self.wait_workers(len(roles), self.spec.ready_timeout_s)

    def _wait_router(self, timeout_s: float) -> None:
        """Until the router answers its health check; RouterExited if its process exits first,
        RuntimeError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        ca = read_ca(self.spec.tls_ca)
        while time.monotonic() < deadline:
            if self.processes["router"].poll() is not None:
                raise RouterExited(f"the router exited during start (address {self.address})"
                                   + (f"; logs in {self.log_dir}" if self.log_dir else ""))
            if wait_healthy(self.address, min(1.0, max(0.1, deadline - time.monotonic())), ca):
                return
        raise RuntimeError(f"router did not become healthy on {self.address}")

    def spawn_worker(self, role: str) -> str:
        """Start one more worker process (it registers with the router on its own); its name is
        also its worker id, e.g. "decode-2". On CUDA it gets the GPU with the fewest live
        workers (launch.gpus.place_worker), so a replacement takes a dead worker's place."""
        name, args = self.worker_command(role)
        self._spawn(name, args)
        return name

    def worker_command(self, role: str) -> tuple[str, list[str]]:
        """The next `role` worker's name and `python -m` arguments; on CUDA its GPU is recorded
        in `gpu_slots` (the process itself is not started here)."""
        index = sum(name.startswith(f"{role}-") for name in self.processes)
        name = f"{role}-{index}"
        module = "prefill_worker" if role == "prefill" else "decode_worker"
        extra = ["--colocated"] if role == "colocated" else []
        return name, [module, "--router", self.registry_address or self.address,
                      "--host", self.spec.host,
                      "--threads", str(self.spec.threads), "--model", self.spec.model,
                      "--worker-id", name, *extra, *self._engine_args(role), *self._gpu_args(name),
                      *self._token_args(), *self._tls_args(False), *self._log_args(),
                      *self.spec.worker_args]

    def _log_args(self) -> list[str]:
        return ["--log-level", self.spec.log_level, "--log-format", self.spec.log_format]

    def _tls_args(self, router: bool) -> list[str]:
        """The router gets its certificate and key, the workers the CA to trust it with; every
        process its cluster certificate (mutual TLS)."""
        spec = self.spec
        args = []
        if router and spec.tls_cert:
            args = ["--tls-cert", spec.tls_cert, "--tls-key", spec.tls_key or ""]
        elif not router and spec.tls_ca:
            args = ["--tls-ca", spec.tls_ca]
        if spec.cluster_cert:
            args += ["--cluster-cert", spec.cluster_cert, "--cluster-key", spec.cluster_key or "",
                     "--cluster-ca", spec.cluster_ca or ""]
        return args

    def _token_args(self) -> list[str]:
        """The token's file, never the token: command lines are visible to `ps`."""
        path = self.spec.cluster_token_file
        return ["--cluster-token-file", path] if path else []

    def resolve_gpus(self) -> int | None:
        """On CUDA: how many GPUs the workers spread over (--gpus, else every visible GPU,
        found without torch), checked against the workers; None on CPU."""
        if self.spec.device == "cuda" and self.num_gpus is None:
            num_gpus = self.spec.gpus or visible_gpus()
            self.spec.check_gpus(num_gpus)
            self.num_gpus = num_gpus
        return self.num_gpus

    def _gpu_args(self, name: str) -> list[str]:
        num_gpus = self.resolve_gpus()
        if num_gpus is None:
            return []
        live = [slot for worker, slot in self.gpu_slots.items()
                if worker in self.processes and worker not in self.signalled
                and self.processes[worker].poll() is None]
        slot = place_worker(live, self.spec.num_workers, num_gpus,
                            self.spec.gpu_memory_fraction)
        self.gpu_slots[name] = slot
        return slot.worker_args

    def signal(self, name: str, sig: int = signal.SIGKILL) -> subprocess.Popen:
        """Send a signal to one process of the cluster (the tests' fault injection)."""
        proc = self.processes[name]
        self.signalled.add(name)
        proc.send_signal(sig)
        return proc

    def _engine_args(self, role: str) -> list[str]:
        spec = self.spec
        args = []
        if spec.dtype:
            args += ["--dtype", spec.dtype]
        if spec.kv_cache_gb is not None:
            args += ["--kv-cache-gb", str(spec.kv_cache_gb)]
        if spec.cuda_graphs is not None:
            args.append("--cuda-graphs" if spec.cuda_graphs else "--no-cuda-graphs")
        if spec.async_scheduling is not None and role != "prefill":
            args.append("--async-scheduling" if spec.async_scheduling else "--no-async-scheduling")
        if spec.fused_kernels is not None:
            args.append("--fused-kernels" if spec.fused_kernels else "--no-fused-kernels")
        if spec.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
        if spec.tp_for(role) > 1:
            args += ["--tensor-parallel-size", str(spec.tp_for(role))]
        return [*args, "--kv-transport", spec.kv_transport]

    def _spawn(self, name: str, args: list[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.spec.threads), PYTHONUNBUFFERED="1")
        if self.log_dir is None:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", *args], cwd=REPO_ROOT, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The child writes through its own copy of the descriptor: ours is closed at once (a
        # launch that replaces workers for days would otherwise hold one per process started).
        with open(self.log_dir / f"{name}.log", "w") as out:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", *args], cwd=REPO_ROOT, env=env, stdout=out,
                stderr=subprocess.STDOUT)

    def status(self, timeout_s: float = 5.0) -> pb.ClusterStatus:
        return cluster_status(self.address, timeout_s, read_ca(self.spec.tls_ca))

    def wait_workers(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.processes.items()
                    if p.poll() is not None and n not in self.signalled]
            if dead:
                raise RuntimeError(f"cluster processes exited during start: {dead}"
                                   + (f" (logs in {self.log_dir})" if self.log_dir else ""))
            try:
                if sum(w.healthy for w in self.status().workers) >= count:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{count} workers did not register within {timeout_s:.0f}s")

    def stop(self, timeout_s: float = 40.0) -> None:
        """SIGTERM workers then the router; SIGKILL whatever has not exited in time."""
        names = [n for n in self.processes if n != "router"] + ["router"]
        for name in names:
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in names:
            proc = self.processes.get(name)
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:  # the next ones are stopped all the same
                    log.error("%s (pid %d) did not exit after SIGKILL", name, proc.pid)

    def __enter__(self) -> LocalCluster:
        return self if self.processes else self.start()  # start() may already have run

    def __exit__(self, *exc: object) -> None:
        self.stop()
