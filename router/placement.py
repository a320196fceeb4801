"""Placement policy: prefill on the worker with the least queued prompt tokens; decode on the
worker with the most free KV blocks that can hold the request.

Load is charged at placement time (not only when the next heartbeat reports it), so a burst of long
prompts spreads over the pool instead of all landing on the worker that looked idle a moment ago.
Charges are released when the worker acknowledges the work (and its heartbeat then reports it).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from router.registry import Role, Worker, WorkerRegistry


@dataclass(frozen=True)
class Charge:
    worker_id: str
    prompt_tokens: int = 0
    blocks: int = 0


class PlacementPolicy:
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry
        self._pending_tokens: dict[str, int] = defaultdict(int)
        self._pending_blocks: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def queued_tokens(self, worker: Worker) -> int:
        return worker.load.queued_prompt_tokens + self._pending_tokens[worker.worker_id]

    def free_blocks(self, worker: Worker) -> int:
        return worker.load.free_blocks - self._pending_blocks[worker.worker_id]

    def place_prefill(self, prompt_tokens: int, exclude: frozenset[str] = frozenset(),
                      roles: tuple[Role, ...] = (Role.PREFILL, Role.COLOCATED)
                      ) -> tuple[Worker, Charge] | None:
        """The prefill worker with the least queued prompt tokens (ties: fewest running)."""
        with self._lock:
            candidates = [w for w in self.registry.placeable(lambda r: r in roles)
                          if w.worker_id not in exclude]
            if not candidates:
                return None
            best = min(candidates, key=lambda w: (self.queued_tokens(w),
                                                  w.load.running_requests, w.worker_id))
            self._pending_tokens[best.worker_id] += prompt_tokens
            return best, Charge(best.worker_id, prompt_tokens=prompt_tokens)

    def place_decode(self, total_tokens: int, exclude: frozenset[str] = frozenset(),
                     roles: tuple[Role, ...] = (Role.DECODE, Role.COLOCATED)
                     ) -> tuple[Worker, Charge] | None:
        """The decode worker with the most free blocks among those that can hold
        `total_tokens` (prompt + max_tokens) of KV; None when none can."""
        with self._lock:
            fits = []
            for w in self.registry.placeable(lambda r: r in roles):
                need = -(-total_tokens // w.block_size)
                if w.worker_id not in exclude and self.free_blocks(w) >= need \
                        and total_tokens <= w.max_model_len:
                    fits.append((w, need))
            if not fits:
                return None
            best, need = max(fits, key=lambda item: (self.free_blocks(item[0]),
                                                     item[0].worker_id))
            self._pending_blocks[best.worker_id] += need
            return best, Charge(best.worker_id, blocks=need)

    def release(self, charge: Charge) -> None:
        """The worker acknowledged (or refused) the work: stop charging it here."""
        with self._lock:
            self._pending_tokens[charge.worker_id] -= charge.prompt_tokens
            self._pending_blocks[charge.worker_id] -= charge.blocks
            if self._pending_tokens[charge.worker_id] <= 0:
                del self._pending_tokens[charge.worker_id]
            if self._pending_blocks[charge.worker_id] <= 0:
                del self._pending_blocks[charge.worker_id]


class Suspects:
    """Workers that just failed one request: not placed on again by that request until
    `ttl_s` passes (by then a dead worker has left the registry, and one still heartbeating is
    alive and worth another try)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self._clock = clock
        self._since: dict[str, float] = {}

    def add(self, worker_id: str) -> None:
        self._since[worker_id] = self._clock()

    def current(self) -> frozenset[str]:
        now = self._clock()
        return frozenset(w for w, t in self._since.items() if now - t < self.ttl_s)
