"""The deployment config (YAML), parsed once into frozen dataclasses and validated before anything
starts. No ray here: the schema is checked (and tested) without a cluster.

Schema (every key optional except where noted; unknown keys are errors):

    name: pdserve              # actor and placement-group names derive from it
    cluster_token_file: null   # a path on every node: the cluster token (security.auth)
    tls:                       # TLS on the router's public ports (deploy.security), paths
      cert_file: null          #   on every node; cert and key together, with the CA that
      key_file: null           #   signed them (workers and the driver check the router)
      ca_file: null
    cluster_tls:               # mutual TLS between all actors: all three or none
      cert_file: null
      key_file: null
      ca_file: null
    ray:
      address: auto            # what ray.init connects to ("auto": the running cluster)
      namespace: pdserve
    model:
      path: default            # "default" or a local HF model directory present on every node
      dtype: null              # float32 | bfloat16 | float16 (null: the device's default)
      kv_cache_gb: null        # per worker (null: the engine's default)
      max_num_batched_tokens: null
    router:
      host: 127.0.0.1          # an interface, or "node-ip" for the node's address
      port: 50051              # fixed: a restarted router must keep its address
      http_port: 8000          # its OpenAI-compatible HTTP API (0: off)
      internal_port: 50052     # with cluster_tls: the worker registry's own port (fixed)
      max_running: 256
      max_queued: 1024
      max_restarts: -1         # -1: restart forever
      num_cpus: 1
    prefill: {replicas: 1, tensor_parallel_size: 1}
    decode: {replicas: 1, tensor_parallel_size: 1}   # a worker of N ranks is a placement group
                               # of N bundles (STRICT_PACK: one node), its ranks 1.. as actors
    workers:
      device: cpu              # cpu: each worker asks for num_cpus; cuda: num_gpus=gpus_per_worker
      num_cpus: 1              # Ray CPUs per worker (also its torch threads on CPU)
      gpus_per_worker: null    # cuda only: a fraction in (0, 1] (null: 1); 0.5 lets 2 share a GPU
      gpu_memory_fraction: null  # cuda only: share of its GPU's memory a worker's engine may use,
                               # in (0, 0.95] (null: 0.9 x gpus_per_worker, rounded down)
      kv_transport: auto       # auto | shared | dist: how KV moves from prefill to decode workers
      host: 127.0.0.1          # or "node-ip" (needed when workers span nodes)
      max_restarts: 3
      grace_s: 30
    placement:
      strategy: PACK           # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (one bundle per worker)
      timeout_s: 120           # waiting for the placement group and for workers to register
    autoscale:                 # the SLO-driven controller (deploy.autoscaler), an actor
      enabled: false
      dry_run: false           # decide and log, change nothing
      slo_file: null           # the load tests' SLO YAML (null: loadtest/slo.yaml)
      interval_s: 10           # how often it reads the router's metrics and decides
      cooldown_s: 30           # after a change, the next one waits this long
      prefill: {min: 1, max: 1}  # bounds per role (min >= 1: the last worker never goes)
      decode: {min: 1, max: 1}
      scale_down_below: 0.5    # every latency under this share of its SLO bound, no queue, KV
                               # use under kv_high / 2 ...
      scale_down_window_s: 60  # ... for this long: one worker goes (drained by migration)
      kv_high: 0.85            # decode workers' mean KV use above this adds a decode worker
      profile: null            # a worker's speed (python -m engine.profile): with `workload`,
      workload: null           # the planner's model picks which role to add or remove
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deploy.schema import build
from deploy.security import (  # noqa: F401 - NODE_IP is the config's vocabulary
    NODE_IP,
    ClusterTlsSection,
    ConfigError,
    Credentials,
    TlsSection,
)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DTYPES = ("float32", "bfloat16", "float16")
MAX_REPLICAS = 64
KV_TRANSPORTS = ("auto", "shared", "dist")
DEFAULT_GPU_MEMORY_FRACTION = 0.9  # of a whole GPU; a worker with part of a GPU gets that part
MAX_GPU_MEMORY_FRACTION = 0.95  # what the workers sharing one GPU may use together, at most


@dataclass(frozen=True)
class RaySection:
    address: str = "auto"
    namespace: str = "pdserve"


@dataclass(frozen=True)
class ModelSection:
    path: str = "default"
    dtype: str | None = None
    kv_cache_gb: float | None = None
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got "
                              f"{self.dtype!r}")
        if self.kv_cache_gb is not None and not 0 < self.kv_cache_gb <= 1024:
            raise ConfigError(f"model.kv_cache_gb must be in (0, 1024], got {self.kv_cache_gb}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("model.max_num_batched_tokens must be >= 1, got "
                              f"{self.max_num_batched_tokens}")
        if self.path != "default" and not (Path(self.path).expanduser() / "config.json").is_file():
            raise ConfigError(f"model.path {self.path!r} is not a local model directory "
                              "(no config.json); it must exist on every node")


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000
    internal_port: int = 50052  # the registry's port under cluster_tls (public clients have no
    # certificate, and gRPC cannot ask only some callers of one port for one)
    max_running: int = 256
    max_queued: int = 1024
    max_restarts: int = -1
    num_cpus: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"router.port must be in [1, 65535] (a fixed port: a restarted "
                              f"router keeps its address), got {self.port}")
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"router.http_port must be in [0, 65535] (0: off): {self.http_port}")
        if not 1 <= self.internal_port <= 65535 or self.internal_port in (self.port,
                                                                          self.http_port):
            raise ConfigError(f"router.internal_port must be in [1, 65535] and differ from "
                              f"router.port and router.http_port, got {self.internal_port}")
        if self.max_running < 1 or self.max_queued < 0:
            raise ConfigError(f"router.max_running must be >= 1 and router.max_queued >= 0, "
                              f"got {self.max_running} and {self.max_queued}")
        _check_restarts("router.max_restarts", self.max_restarts)
        if self.num_cpus < 0:
            raise ConfigError(f"router.num_cpus must be >= 0, got {self.num_cpus}")


MAX_TP = 64


@dataclass(frozen=True)
class ReplicasSection:
    replicas: int = 1
    tensor_parallel_size: int = 1  # ranks per worker of this role, one bundle and process each


@dataclass(frozen=True)
class WorkersSection:
    """Ray shows each GPU actor only its own GPU (CUDA_VISIBLE_DEVICES), as cuda:0: two actors
    sharing one GPU (gpus_per_worker < 1) can use the shared (CUDA IPC) KV transport, actors on
    different GPUs fall back to dist (NCCL) under auto — which cannot put two ranks on one GPU."""

    device: str = "cpu"
    num_cpus: int = 1
    host: str = "127.0.0.1"
    max_restarts: int = 3
    grace_s: float = 30.0
    gpus_per_worker: float | None = None
    gpu_memory_fraction: float | None = None
    kv_transport: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"workers.device must be cpu or cuda, got {self.device!r}")
        if not 1 <= self.num_cpus <= 256:
            raise ConfigError(f"workers.num_cpus must be in [1, 256], got {self.num_cpus}")
        _check_restarts("workers.max_restarts", self.max_restarts)
        if not self.grace_s > 0:
            raise ConfigError(f"workers.grace_s must be > 0, got {self.grace_s}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ConfigError(f"workers.kv_transport must be one of {', '.join(KV_TRANSPORTS)}, "
                              f"got {self.kv_transport!r}")
        self._check_gpu_keys()

    def _check_gpu_keys(self) -> None:
        for key in ("gpus_per_worker", "gpu_memory_fraction"):
            if getattr(self, key) is not None and self.device != "cuda":
                raise ConfigError(f"workers.{key} needs workers.device: cuda")
        if self.device != "cuda":
            return
        if not 0 < self.num_gpus <= 1:
            raise ConfigError(f"workers.gpus_per_worker must be in (0, 1], got "
                              f"{self.gpus_per_worker}")
        fraction = self.gpu_memory_fraction
        if fraction is not None and not 0 < fraction <= MAX_GPU_MEMORY_FRACTION:
            raise ConfigError(f"workers.gpu_memory_fraction must be in (0, "
                              f"{MAX_GPU_MEMORY_FRACTION}], got {fraction}")
        sharing = math.floor(1 / self.num_gpus + 1e-9)  # workers Ray may put on one GPU
        fraction = self.worker_gpu_memory_fraction or 0.0
        if not 0 < sharing * fraction <= MAX_GPU_MEMORY_FRACTION + 1e-9:
            raise ConfigError(f"workers.gpu_memory_fraction {fraction:g} x {sharing} workers on "
                              f"one GPU (gpus_per_worker {self.num_gpus:g}) must be in (0, "
                              f"{MAX_GPU_MEMORY_FRACTION}] of it")
        if self.kv_transport == "dist" and sharing > 1:
            raise ConfigError(f"workers.kv_transport dist needs a whole GPU per worker "
                              f"(gpus_per_worker is {self.num_gpus:g}): NCCL cannot put two "
                              f"ranks on one GPU; use auto or shared")

    @property
    def num_gpus(self) -> float:
        """The GPUs each worker actor asks Ray for (0 on CPU)."""
        if self.device != "cuda":
            return 0.0
        return 1.0 if self.gpus_per_worker is None else self.gpus_per_worker

    @property
    def worker_gpu_memory_fraction(self) -> float | None:
        """--gpu-memory-fraction: the key, else 0.9 x gpus_per_worker rounded down; None on CPU."""
        if self.device != "cuda":
            return None
        if self.gpu_memory_fraction is not None:
            return self.gpu_memory_fraction
        return math.floor(round(DEFAULT_GPU_MEMORY_FRACTION * self.num_gpus * 100, 6)) / 100

    @property
    def bundle(self) -> dict[str, float]:
        """One worker's placement-group bundle: its CPUs, plus its (part of a) GPU on CUDA."""
        return {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.device == "cuda" else {})}

    def worker_options(self) -> dict[str, Any]:
        """The serving.options.WorkerOptions fields every worker gets from this section."""
        options: dict[str, Any] = {"device": self.device, "threads": self.num_cpus,
                                   "kv_transport": self.kv_transport}
        if self.worker_gpu_memory_fraction is not None:
            options["gpu_memory_fraction"] = self.worker_gpu_memory_fraction
        return options


@dataclass(frozen=True)
class PlacementSection:
    strategy: str = "PACK"
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"placement.strategy must be one of {', '.join(STRATEGIES)}, got "
                              f"{self.strategy!r}")
        if not 0 < self.timeout_s <= 3600:
            raise ConfigError(f"placement.timeout_s must be in (0, 3600], got {self.timeout_s}")


@dataclass(frozen=True)
class RoleBounds:
    min: int = 1
    max: int = 1


@dataclass(frozen=True)
class AutoscaleSection:
    enabled: bool = False
    dry_run: bool = False
    slo_file: str | None = None
    interval_s: float = 10.0
    cooldown_s: float = 30.0
    prefill: RoleBounds = field(default_factory=RoleBounds)
    decode: RoleBounds = field(default_factory=RoleBounds)
    scale_down_below: float = 0.5
    scale_down_window_s: float = 60.0
    kv_high: float = 0.85
    profile: str | None = None
    workload: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.interval_s <= 3600 or not 0 <= self.cooldown_s <= 86400:
            raise ConfigError(f"autoscale.interval_s must be in (0, 3600] and cooldown_s in "
                              f"[0, 86400], got {self.interval_s} and {self.cooldown_s}")
        for role in ("prefill", "decode"):
            bounds = getattr(self, role)
            if not 1 <= bounds.min <= bounds.max <= MAX_REPLICAS:
                raise ConfigError(f"autoscale.{role} needs 1 <= min <= max <= {MAX_REPLICAS} "
                                  f"(the last worker of a role never goes), got min "
                                  f"{bounds.min}, max {bounds.max}")
        if not 0 <= self.scale_down_window_s <= 86400:
            raise ConfigError(f"autoscale.scale_down_window_s must be in [0, 86400], got "
                              f"{self.scale_down_window_s}")
        if not 0 < self.scale_down_below < 1 or not 0 < self.kv_high <= 1:
            raise ConfigError(f"autoscale.scale_down_below must be in (0, 1) and kv_high in "
                              f"(0, 1], got {self.scale_down_below} and {self.kv_high}")
        if (self.profile is None) != (self.workload is None):
            raise ConfigError("autoscale.profile and autoscale.workload go together: the "
                              "planner's model needs a worker's speed and the request shapes")
        for key in ("slo_file", "profile", "workload"):
            path = getattr(self, key)
            if path is None:
                continue
            if not Path(path).expanduser().is_file():
                raise ConfigError(f"autoscale.{key} {path!r} is not a file (read where "
                                  "`deploy up` runs, and by the autoscaler on the head node)")
            # The actor reads it from its own working directory: the path must not depend on it
            object.__setattr__(self, key, str(Path(path).expanduser().resolve()))
        self._check_contents()

    def _check_contents(self) -> None:
        """The files parse here, before anything starts (the actor reads them again)."""
        from loadtest.slo import SLO

        try:
            if self.slo_file is not None:
                SLO.from_yaml(self.slo_file)
            if self.profile is not None and self.workload is not None:
                from planner.plan import load_workload
                from planner.simulator import Profile

                Profile.from_json(json.loads(Path(self.profile).read_text()))
                load_workload(Path(self.workload), None)
        except (ValueError, OSError, TypeError, KeyError) as exc:
            raise ConfigError(f"autoscale: {exc}") from exc


@dataclass(frozen=True)
class DeployConfig:
    name: str = "pdserve"
    ray: RaySection = field(default_factory=RaySection)
    model: ModelSection = field(default_factory=ModelSection)
    router: RouterSection = field(default_factory=RouterSection)
    prefill: ReplicasSection = field(default_factory=ReplicasSection)
    decode: ReplicasSection = field(default_factory=ReplicasSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    cluster_token_file: str | None = None  # read by each actor on its node
    tls: TlsSection = field(default_factory=TlsSection)  # paths, read by each actor on its node
    cluster_tls: ClusterTlsSection = field(default_factory=ClusterTlsSection)
    autoscale: AutoscaleSection = field(default_factory=AutoscaleSection)

    def __post_init__(self) -> None:
        if self.cluster_token_file == "":
            raise ConfigError("cluster_token_file must be a path (or null)")
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"name must be letters, digits, '-' or '_', got {self.name!r}")
        for role, replicas in (("prefill", self.prefill.replicas),
                               ("decode", self.decode.replicas)):
            if not 1 <= replicas <= MAX_REPLICAS:
                raise ConfigError(f"{role}.replicas must be in [1, {MAX_REPLICAS}], got "
                                  f"{replicas}")
        self._check_tensor_parallel()
        for role in ("prefill", "decode"):
            bounds, replicas = getattr(self.autoscale, role), getattr(self, role).replicas
            if self.autoscale.enabled and not bounds.min <= replicas <= bounds.max:
                raise ConfigError(f"{role}.replicas ({replicas}) must lie within autoscale."
                                  f"{role} [{bounds.min}, {bounds.max}]")

    def _check_tensor_parallel(self) -> None:
        for role in ("prefill", "decode"):
            size = self.tp_for(role)
            if not 1 <= size <= MAX_TP:
                raise ConfigError(f"{role}.tensor_parallel_size must be in [1, {MAX_TP}], got "
                                  f"{size}")
            if size > 1 and self.workers.device != "cpu":
                raise ConfigError(f"{role}.tensor_parallel_size > 1 runs on CPU ranks only so "
                                  "far (its CUDA path is unproven): set workers.device: cpu")

    def tp_for(self, role: str) -> int:
        """Ranks per worker of `role`."""
        return getattr(self, role).tensor_parallel_size

    @property
    def credentials(self) -> Credentials:
        return Credentials(self.cluster_token_file, self.tls, self.cluster_tls)

    def worker_engine(self, role: str = "decode") -> dict[str, Any]:
        """The WorkerOptions fields (besides role, ids and addresses) a `role` worker gets."""
        model = self.model
        return {"model": model.path, "dtype": model.dtype, "kv_cache_gb": model.kv_cache_gb,
                "max_num_batched_tokens": model.max_num_batched_tokens,
                "tensor_parallel_size": self.tp_for(role), **self.workers.worker_options()}

    @property
    def worker_names(self) -> list[tuple[str, str]]:
        """(role, worker id) for every worker, e.g. ("decode", "decode-1")."""
        return [(role, f"{role}-{i}") for role in ("prefill", "decode")
                for i in range(getattr(self, role).replicas)]

    @classmethod
    def from_yaml(cls, path: str | Path) -> DeployConfig:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read deployment config {path}: {exc}") from exc
        return cls.from_dict(data or {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeployConfig:
        return build(cls, data, _SECTIONS)


def _check_restarts(key: str, value: int) -> None:
    if value < -1:
        raise ConfigError(f"{key} must be -1 (forever) or >= 0, got {value}")


_SECTIONS: dict[str, type] = {
    "RaySection": RaySection, "ModelSection": ModelSection, "RouterSection": RouterSection,
    "ReplicasSection": ReplicasSection, "WorkersSection": WorkersSection,
    "PlacementSection": PlacementSection, "TlsSection": TlsSection,
    "ClusterTlsSection": ClusterTlsSection, "AutoscaleSection": AutoscaleSection,
    "RoleBounds": RoleBounds,
}
