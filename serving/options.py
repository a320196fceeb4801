"""Worker configuration, parsed once at the edge (CLI) into a frozen, validated dataclass."""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass, field

from common.logs import add_logging_args, check_logging
from engine.config import SchedulerConfig
from kv_transfer.connectors import ConnectorOptions
from kv_transfer.selection import MODES
from security.auth import load_token
from security.tls import ClusterTls, add_cluster_tls_args, read_ca

QUEUE_POLICIES = SchedulerConfig.QUEUE_POLICIES
DECODE_PREFILL_CHUNK = {"cpu": 32, "cuda": 512}
# A colocated worker's step budget on CPU: vllm serve's CPU default. Against the engine's 512,
# served through `vllm bench serve` (256-token prompts, 128 tokens, 1/2/4 req/s, float32, 2 AVX2
# cores, medians of 2): request rate +1-6% and ITL p50 6-11% lower at every rate, ITL p90 ~2.8x
# lower at 2 and 4 req/s; TTFT p50 +1% / -11% / +5% (BENCHMARKS.md). Other roles keep 512: their
# budgets were not measured served.
COLOCATED_CPU_STEP_BUDGET = 2048


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # "prefill", "decode" or "colocated"
    router: str  # host:port of the router's gRPC server
    host: str = "127.0.0.1"  # interface the worker binds (gRPC and KV rendezvous)
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # address others use to reach it (default: host)
    model: str = "default"
    dtype: str | None = None
    device: str = "cpu"  # "cpu" or "cuda[:N]"; the KV transfer backend follows it (gloo/NCCL)
    kv_cache_gb: float | None = None
    max_num_batched_tokens: int | None = None
    # Prefill queue order (engine SchedulerConfig): short chat prompts ahead of long documents,
    # anything older than the age bound first (issue 16). The offline engine stays fcfs.
    queue_policy: str = "short_first"
    queue_age_bound_s: float = 4.0
    # Prompt tokens one request computes per step (None: the step budget; a decode worker's
    # default keeps its streams' inter-token latency while it prefills locally).
    prefill_chunk_size: int | None = None
    threads: int = 1  # torch threads: workers share the machine's cores
    # Ranks the model is split over, one process each (engine.tensor_parallel); a prefill and a
    # decode worker may differ in it (the KV transports move each rank's heads: kv_transfer.heads).
    tensor_parallel_size: int = 1
    worker_id: str = ""
    connect_timeout_s: float = 60.0  # waiting for the router at start
    transfer_timeout_s: float = 30.0  # one KV transfer (rendezvous included)
    lease_s: float = 30.0  # decode: reserved blocks freed when no KV arrives in this time
    grace_s: float = 30.0  # drain: accepted work allowed to finish after SIGTERM
    log_level: str = "info"
    log_format: str = "text"  # text | json (common.logs)
    metrics_port: int = 0  # Prometheus /metrics HTTP port on `host` (0: any free port)
    max_queued_requests: int = 1024  # new requests waiting on this worker beyond this: refused
    kv_transport: str = "auto"  # auto | shared | dist: how KV moves between P and D (kv_transfer)
    # Prefill: ship each chunk's finished blocks while later chunks compute (a copy on shared, a
    # piece on dist), so a long prompt's first token waits only for its last chunk's (issue 16).
    kv_streaming: bool = True
    gpu_memory_fraction: float = 0.9  # CUDA: share of the GPU's total memory this engine may use
    # The GPU speed paths. None: the device's default, on for CUDA (H200 cluster runs proved
    # workers with each token-identical to the offline engine: BENCHMARKS.md, "GPU proof"), off
    # elsewhere (nothing to overlap on a CPU). Decode steps replay CUDA graphs
    # (engine.decode_graphs).
    cuda_graphs: bool | None = None
    # Schedule step N+1 while step N runs (engine async scheduling); decode and colocated only:
    # a prefill worker hands a request off right after the step that samples its first token.
    async_scheduling: bool | None = None
    # Fused Triton element-wise kernels (engine.models.fused): CUDA only.
    fused_kernels: bool | None = None
    # Fault injection for the tests only (env PDSERVE_FAULT_KV_WRITE_PAUSE_S): a prefill worker
    # pauses this long inside each shared-transport write, after the decode side admitted it.
    fault_kv_write_pause_s: float = 0.0
    # ... (env PDSERVE_FAULT_MOVE_PAUSE_S): a decode worker moving a running request's KV waits
    # this long after the target reserved and before the KV goes (a window to kill the target).
    fault_move_pause_s: float = 0.0
    # The cluster token (security.auth): from --cluster-token-file or PDSERVE_CLUSTER_TOKEN.
    cluster_token: str | None = field(default=None, repr=False)
    tls_ca: str | None = None  # the CA the router's TLS certificate is checked against
    cluster_tls: ClusterTls | None = None  # mutual TLS with every other process of the cluster

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role must be prefill, decode or colocated, got {self.role!r}")
        check_logging(self.log_level, self.log_format)
        if ":" not in self.router:
            raise ValueError(f"--router must be host:port, got {self.router!r}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 65535], got "
                                 f"{getattr(self, name)}")
        read_ca(self.tls_ca)  # unreadable or not PEM: ValueError now, not at registration
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got "
                             f"{self.max_queued_requests}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        self._check_speed_paths()
        if self.kv_transport not in MODES:
            raise ValueError(f"--kv-transport must be one of {', '.join(MODES)}, got "
                             f"{self.kv_transport!r}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"--queue-policy must be one of {', '.join(QUEUE_POLICIES)}, got "
                             f"{self.queue_policy!r}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"--prefill-chunk-size must be >= 1, got {self.prefill_chunk_size}")
        self._check_numbers()
        self._check_tensor_parallel()
        if not self.worker_id:
            object.__setattr__(self, "worker_id",
                               f"{self.role}-{os.getpid()}-{uuid.uuid4().hex[:6]}")

    def _check_speed_paths(self) -> None:
        """Resolves the speed paths left unset for the device, then checks the ones asked for."""
        cuda = self.device.startswith("cuda")
        if self.cuda_graphs is None:
            object.__setattr__(self, "cuda_graphs", cuda)
        if self.async_scheduling is None:
            object.__setattr__(self, "async_scheduling", cuda and self.role != "prefill")
        if self.fused_kernels is None:
            object.__setattr__(self, "fused_kernels", cuda)
        if self.async_scheduling and self.role == "prefill":
            raise ValueError("--async-scheduling is for decode and colocated workers, not "
                             "prefill workers")
        for flag, on in (("--cuda-graphs", self.cuda_graphs),
                         ("--fused-kernels", self.fused_kernels)):
            if on and not cuda:
                raise ValueError(f"{flag} needs --device cuda[:N], got {self.device!r}")

    def _check_numbers(self) -> None:
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"--kv-cache-gb must be > 0, got {self.kv_cache_gb}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        if not 0 < self.gpu_memory_fraction <= 0.95:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 0.95], got "
                             f"{self.gpu_memory_fraction}")
        for name in ("connect_timeout_s", "transfer_timeout_s", "lease_s", "grace_s",
                     "queue_age_bound_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def _check_tensor_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and (self.device != "cpu" or self.async_scheduling):
            raise ValueError("--tensor-parallel-size > 1 runs on CPU ranks without "
                             "--async-scheduling so far (its GPU path is unproven)")

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def step_budget(self) -> int | None:
        """The engine's max_num_batched_tokens: the flag, else the colocated CPU default, else
        None (the engine's default for the device)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.role == "colocated" and not self.device.startswith("cuda"):
            return COLOCATED_CPU_STEP_BUDGET
        return None

    @property
    def chunk_size(self) -> int | None:
        """The prefill chunk the engine gets. A decode worker prefills only prompts the router
        sends it whole (conditional disaggregation): in small chunks, so each step stays near a
        decode step (measured on 2 CPU cores: ~4 ms per prompt token on one core, so 32 tokens
        add ~130 ms to a ~100 ms decode step). The CUDA figure is unmeasured."""
        if self.prefill_chunk_size is not None or self.role != "decode":
            return self.prefill_chunk_size
        return DECODE_PREFILL_CHUNK["cuda" if self.device.startswith("cuda") else "cpu"]


def connector_options(options: WorkerOptions) -> ConnectorOptions:
    """What the worker's KV connectors are built with."""
    return ConnectorOptions(options.worker_id, options.host, options.public_host,
                            options.kv_transport, options.transfer_timeout_s,
                            options.fault_kv_write_pause_s)


def parse_worker_args(role: str, argv: list[str] | None = None) -> WorkerOptions:
    parser = argparse.ArgumentParser(prog=f"python -m {role}_worker",
                                     description=f"Run one {role} worker.")
    if role == "decode":
        parser.add_argument("--colocated", action="store_true",
                            help="also prefill: one worker does both (the baseline)")
    _add_process_args(parser)
    _add_scheduler_args(parser)
    _add_transfer_args(parser)
    _add_security_args(parser)
    _add_device_args(parser)
    args = parser.parse_args(argv)
    if getattr(args, "colocated", False):
        role = "colocated"
    try:
        return _options(role, args)
    except ValueError as exc:  # a bad value or token file: a usage error, not a traceback
        parser.error(str(exc))


def _options(role: str, args: argparse.Namespace) -> WorkerOptions:
    return WorkerOptions(
        role=role, router=args.router, host=args.host, port=args.port,
        advertise_host=args.advertise_host, model=args.model, dtype=args.dtype,
        device=args.device,
        kv_cache_gb=args.kv_cache_gb, max_num_batched_tokens=args.max_num_batched_tokens,
        queue_policy=args.queue_policy, queue_age_bound_s=args.queue_age_bound_s,
        prefill_chunk_size=args.prefill_chunk_size,
        threads=args.threads, tensor_parallel_size=args.tensor_parallel_size,
        worker_id=args.worker_id, lease_s=args.lease_s,
        transfer_timeout_s=args.transfer_timeout_s, grace_s=args.grace_s,
        metrics_port=args.metrics_port, max_queued_requests=args.max_queued_requests,
        log_level=args.log_level, log_format=args.log_format,
        kv_transport=args.kv_transport, kv_streaming=args.kv_streaming == "on",
        gpu_memory_fraction=args.gpu_memory_fraction, cuda_graphs=args.cuda_graphs,
        async_scheduling=args.async_scheduling, fused_kernels=args.fused_kernels,
        fault_kv_write_pause_s=float(os.environ.get("PDSERVE_FAULT_KV_WRITE_PAUSE_S", "0")),
        fault_move_pause_s=float(os.environ.get("PDSERVE_FAULT_MOVE_PAUSE_S", "0")),
        cluster_token=load_token(args.cluster_token_file), tls_ca=args.tls_ca,
        cluster_tls=ClusterTls.load(args.cluster_cert, args.cluster_key, args.cluster_ca))


def _add_process_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", required=True, help="router address host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--advertise-host", default=None)
    parser.add_argument("--model", default="default", help="'default' or a local HF directory")
    add_logging_args(parser)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-gb", type=float, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over N ranks, one process each (colocated "
                             "workers, CPU, so far)")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="on SIGTERM: seconds accepted work may take to finish")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus /metrics port (0: any free port, shown at start)")
    parser.add_argument("--max-queued-requests", type=int, default=1024)


def _add_transfer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--transfer-timeout-s", type=float, default=30.0)
    parser.add_argument("--kv-transport", default="auto", choices=list(MODES),
                        help="how KV moves between prefill and decode workers: shared (one-sided "
                             "writes into the peer's cache, same host only), dist (torch."
                             "distributed pair groups), auto (shared on one host, else dist)")
    parser.add_argument("--kv-streaming", default="on", choices=["on", "off"],
                        help="prefill: ship each chunk's KV to the decode worker while the next "
                             "chunks compute (off: all after the prompt)")


def _add_security_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster-token-file", default=None,
                        help="the cluster's shared secret (else env PDSERVE_CLUSTER_TOKEN); "
                             "internal RPCs without it are refused")
    parser.add_argument("--tls-ca", default=None,
                        help="PEM CA to check the router's TLS certificate with (when the "
                             "router runs with --tls-cert)")
    add_cluster_tls_args(parser)


def _add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step (default: 2048 on a colocated CPU worker, else "
                             "512 on CPU and 8192 on CUDA)")
    parser.add_argument("--queue-policy", default="short_first", choices=list(QUEUE_POLICIES),
                        help="prompt order: fcfs (arrival) or short_first (fewest prompt tokens "
                             "left first, bounded by --queue-age-bound-s)")
    parser.add_argument("--queue-age-bound-s", type=float, default=4.0,
                        help="short_first: a request waiting longer than this goes first, "
                             "oldest first, so long prompts cannot starve")
    parser.add_argument("--prefill-chunk-size", type=int, default=None,
                        help="prompt tokens a request computes per step (default: the step "
                             "budget; on a decode worker 32 on CPU, 512 on CUDA)")


def _add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9,
                        help="CUDA: share of the GPU's total memory this worker may use (weights "
                             "+ activations + KV cache; the KV cache gets what is left)")
    on = argparse.BooleanOptionalAction  # --x / --no-x; unset: the device's default
    parser.add_argument("--cuda-graphs", action=on, default=None,
                        help="CUDA: replay decode steps from CUDA graphs captured at start "
                             "(default: on for CUDA)")
    parser.add_argument("--async-scheduling", action=on, default=None,
                        help="decode/colocated: schedule and prepare step N+1 while step N runs "
                             "(same outputs; default: on for CUDA, off on CPU)")
    parser.add_argument("--fused-kernels", action=on, default=None,
                        help="CUDA: fused Triton element-wise kernels for residual-add + RMSNorm, "
                             "RoPE and SiLU-up (default: on for CUDA)")
