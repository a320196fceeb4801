"""Worker registry: who is serving, their last reported load, and who stopped heartbeating.

Plain Python (the router imports no torch). Time comes from an injectable clock for tests.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kv_transfer.selection import KVPlace


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefill and decode in one worker

    def can_prefill(self) -> bool:
        return self in (Role.PREFILL, Role.COLOCATED)

    def can_decode(self) -> bool:
        return self in (Role.DECODE, Role.COLOCATED)


@dataclass(frozen=True)
class WorkerLoad:
    queued_prompt_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


@dataclass
class Worker:
    worker_id: str
    role: Role
    address: str
    block_size: int
    max_model_len: int
    transfer_host: str = "127.0.0.1"
    load: WorkerLoad = field(default_factory=WorkerLoad)
    last_heartbeat: float = 0.0
    draining: bool = False  # it said so (SIGTERM): it takes nothing new and goes away
    operator_drained: bool = False  # an operator drained it here (RouterAdmin.DrainWorker)
    metrics_address: str = ""
    host_id: str = ""  # where its KV cache lives: picks the KV transport of each pair
    kv_device: str = "cpu"
    kv_transport: str = "auto"
    kv_receiver_id: str = ""  # decode: names its KV receivers, new in every process
    tensor_parallel_size: int = 1  # ranks its model is split over
    # What a peer's KV cache must match (layers, block size, KV heads, head size, dtype), as the
    # worker reports it; "" when it does not say.
    kv_layout: str = ""
    # The most prompt tokens a request gets in one of its steps (0: it did not say): a decode
    # worker prefills a prompt the router sends it whole in chunks of this size.
    prefill_chunk_tokens: int = 0
    # The keys of the KV blocks its prefix cache holds, as last reported (cache-aware placement).
    prefix_hashes: frozenset[int] = frozenset()

    def kv_place(self) -> KVPlace:
        return KVPlace(self.worker_id, self.host_id, self.kv_device, self.kv_transport)

    @property
    def leaving(self) -> str:
        """Why nothing new goes to it ("" when work does): "drain" or "operator"."""
        return "drain" if self.draining else "operator" if self.operator_drained else ""


class WorkerIdTaken(Exception):
    """Registration under the id of a live worker of another process."""


class KVLayoutMismatch(ValueError):
    """A prefill or decode worker whose KV cache its peers' cannot exchange blocks with."""


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic):
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._workers: dict[str, Worker] = {}
        # Operator drains by worker id: they outlive the entry, so a worker dropped for missed
        # heartbeats (a partition) comes back drained, not taking work again.
        self._drained: set[str] = set()
        self._lock = threading.Lock()

    def register(self, worker: Worker) -> None:
        """Add (or renew) a worker; KVLayoutMismatch when it is a prefill or decode worker whose
        KV cache could not move to or from the ones registered already."""
        with self._lock:
            self._check_layout(worker)
            known = self._workers.get(worker.worker_id)
            self._check_same_process(known, worker)
            worker.last_heartbeat = self._clock()
            worker.operator_drained = worker.worker_id in self._drained
            self._workers[worker.worker_id] = worker

    def _check_same_process(self, known: Worker | None, worker: Worker) -> None:
        """A live worker's id is not taken over by another process (another address, or other
        KV receivers): both would heartbeat into one entry, one of them never dropped. The
        newcomer gets in once the first has missed its heartbeats."""
        if known is None or self._clock() - known.last_heartbeat > self.heartbeat_timeout_s:
            return
        if (known.address, known.kv_receiver_id) != (worker.address, worker.kv_receiver_id):
            raise WorkerIdTaken(
                f"worker_id {worker.worker_id!r} is held by a live worker at {known.address} "
                f"(this one is at {worker.address}); retry once it is gone, or pick another id")

    def drain(self, worker_id: str, drained: bool = True) -> Worker | None:
        """An operator drains a worker (nothing new is placed on it; its running requests
        move), or undoes it; the worker, or None when unknown."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None:
                worker.operator_drained = drained
                (self._drained.add if drained else self._drained.discard)(worker_id)
            return None if worker is None else replace(worker)

    def _check_layout(self, worker: Worker) -> None:
        if worker.role is Role.COLOCATED or not worker.kv_layout:
            return  # a colocated worker's KV never moves
        now = self._clock()
        for other in self._workers.values():
            if now - other.last_heartbeat > self.heartbeat_timeout_s:
                continue  # gone, only not yet dropped
            if other.worker_id != worker.worker_id and other.role is not Role.COLOCATED \
                    and other.kv_layout and other.kv_layout != worker.kv_layout:
                raise KVLayoutMismatch(
                    f"{worker.role.value} worker {worker.worker_id}'s KV cache is "
                    f"[{worker.kv_layout}] but {other.role.value} worker {other.worker_id}'s is "
                    f"[{other.kv_layout}]: KV blocks cannot move between them (tensor-parallel "
                    "sizes may differ; layers, block size, KV heads, head size and dtype must "
                    "not)")

    def heartbeat(self, worker_id: str, load: WorkerLoad, draining: bool = False,
                  prefix_hashes: frozenset[int] | None = None) -> bool:
        """Record a worker's load (and its prefix-cache digest, when it sent one); False when the
        worker is unknown (it must register again)."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                return False
            worker.load = load
            worker.draining = draining
            if prefix_hashes is not None:
                worker.prefix_hashes = prefix_hashes
            worker.last_heartbeat = self._clock()
            return True

    def remove(self, worker_id: str) -> Worker | None:
        with self._lock:
            return self._workers.pop(worker_id, None)

    def drop_dead(self) -> list[Worker]:
        """Forget workers whose last heartbeat is older than the timeout; return them."""
        now = self._clock()
        with self._lock:
            dead = [w for w in self._workers.values()
                    if now - w.last_heartbeat > self.heartbeat_timeout_s]
            for worker in dead:
                del self._workers[worker.worker_id]
        return dead

    def get(self, worker_id: str) -> Worker | None:
        with self._lock:
            return self._workers.get(worker_id)

    def snapshot(self) -> list[Worker]:
        """Copies of every known worker (safe to read without the lock)."""
        with self._lock:
            return [replace(w) for w in self._workers.values()]

    def placeable(self, can: Callable[[Role], bool]) -> list[Worker]:
        """Live workers taking work (not draining or drained) whose role passes `can` (copies)."""
        now = self._clock()
        return [w for w in self.snapshot()
                if can(w.role) and not w.leaving
                and now - w.last_heartbeat <= self.heartbeat_timeout_s]

    def seconds_since_heartbeat(self, worker: Worker) -> float:
        return self._clock() - worker.last_heartbeat

    def live(self, worker: Worker) -> bool:
        return self.seconds_since_heartbeat(worker) <= self.heartbeat_timeout_s
