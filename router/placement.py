"""Placement policy: prefill on the worker with the least queued prompt tokens; decode on the
worker with the most free KV blocks that can hold the request. Only pairs whose KV can move are
placed together: the pair's transport follows where the two workers are (kv_transfer.selection),
and a pair found unworkable at run time (the decode cache could not be mapped, say) is not placed
together again while both stay registered.

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

from kv_transfer.selection import TransportRefused, choose_transport
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
        # (prefill id and address, decode id, address and export) -> why. A worker that restarts
        # comes back at a new address or export, so its past failures do not count against it.
        self._broken: dict[tuple[str, ...], str] = {}
        self._lock = threading.Lock()

    def refusal(self, prefill: Worker, decode: Worker) -> str | None:
        """Why KV cannot go from `prefill` to `decode` (None: it can)."""
        broken = self._broken.get(_pair(prefill, decode))
        if broken is not None:
            return broken
        try:
            choose_transport(prefill.kv_place(), decode.kv_place())
        except TransportRefused as exc:
            return str(exc)
        return None

    def mark_broken(self, prefill: Worker, decode: Worker, reason: str) -> None:
        """A transfer between the two failed in a way that would repeat."""
        self._broken[_pair(prefill, decode)] = reason

    def unpairable(self) -> str | None:
        """When prefill and decode workers exist but no pair of them can move KV: why, naming
        each pair; else None."""
        prefills = self.registry.placeable(lambda r: r is Role.PREFILL)
        decodes = self.registry.placeable(lambda r: r is Role.DECODE)
        if not prefills or not decodes:
            return None
        reasons = []
        for decode in decodes:
            for prefill in prefills:
                reason = self.refusal(prefill, decode)
                if reason is None:
                    return None
                reasons.append(reason)
        return "no prefill worker can send KV to any decode worker: " + "; ".join(reasons)

    def has_partner(self, decode: Worker) -> bool:
        return any(self.refusal(p, decode) is None
                   for p in self.registry.placeable(lambda r: r is Role.PREFILL))

    def queued_tokens(self, worker: Worker) -> int:
        return worker.load.queued_prompt_tokens + self._pending_tokens[worker.worker_id]

    def free_blocks(self, worker: Worker) -> int:
        return worker.load.free_blocks - self._pending_blocks[worker.worker_id]

    def place_prefill(self, prompt_tokens: int, exclude: frozenset[str] = frozenset(),
                      roles: tuple[Role, ...] = (Role.PREFILL, Role.COLOCATED),
                      decode: Worker | None = None) -> tuple[Worker, Charge] | None:
        """The prefill worker with the least queued prompt tokens (ties: fewest running) among
        those that can send KV to `decode`."""
        with self._lock:
            candidates = [w for w in self.registry.placeable(lambda r: r in roles)
                          if w.worker_id not in exclude
                          and (decode is None or self.refusal(w, decode) is None)]
            if not candidates:
                return None
            best = min(candidates, key=lambda w: (self.queued_tokens(w),
                                                  w.load.running_requests, w.worker_id))
            self._pending_tokens[best.worker_id] += prompt_tokens
            return best, Charge(best.worker_id, prompt_tokens=prompt_tokens)

    def place_decode(self, total_tokens: int, exclude: frozenset[str] = frozenset(),
                     roles: tuple[Role, ...] = (Role.DECODE, Role.COLOCATED),
                     paired: bool = False) -> tuple[Worker, Charge] | None:
        """The decode worker with the most free blocks among those that can hold
        `total_tokens` (prompt + max_tokens) of KV (and, if `paired`, that some prefill worker
        can send KV to); None when none can."""
        with self._lock:
            fits = []
            for w in self.registry.placeable(lambda r: r in roles):
                need = -(-total_tokens // w.block_size)
                if w.worker_id not in exclude and self.free_blocks(w) >= need \
                        and total_tokens <= w.max_model_len \
                        and (not paired or self.has_partner(w)):
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


def _pair(prefill: Worker, decode: Worker) -> tuple[str, ...]:
    # The export address is new in every decode process, even one restarted on the same port.
    return (prefill.worker_id, prefill.address, decode.worker_id, decode.address,
            decode.kv_export_address)


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
