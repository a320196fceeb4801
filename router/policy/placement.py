"""Placement policy: prefill on the worker that would finish the prompt first — the least prefill
work queued there plus the part of the prompt its prefix cache does not hold (cache-aware, in the
manner of SGLang's and Dynamo's KV-aware routers; `cache_aware=False` counts load only); decode on
the worker with the most free KV blocks, counting the prompt's blocks it caches already, among
those that can hold the request. Only pairs whose KV can move are
placed together: the pair's transport follows where the two workers are (kv_transfer.selection),
and a pair found unworkable at run time (the decode cache could not be mapped, say) is not placed
together again while both stay registered.

What a worker caches comes from the digests workers report with their heartbeats, plus what the
router itself just placed there (a burst of requests sharing a system prompt follows the first one
instead of spreading before any digest shows the prefix): those keys are expected for EXPECT_S.

Load is charged at placement time (not only when the next heartbeat reports it), so a burst of long
prompts spreads over the pool instead of all landing on the worker that looked idle a moment ago.
Charges are released when the worker acknowledges the work (and its heartbeat then reports it).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.block_manager import prefix_hashes
from kv_transfer.selection import TransportRefused, choose_transport
from router.fleet.registry import Role, Worker, WorkerRegistry
from router.policy.prefill_site import SiteInputs


@dataclass(frozen=True)
class Charge:
    worker_id: str
    prompt_tokens: int = 0
    blocks: int = 0


EXPECT_S = 10.0  # a placed prompt's blocks count as cached there this long (or until reported)


class PlacementPolicy:
    def __init__(self, registry: WorkerRegistry, cache_aware: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.cache_aware = cache_aware
        self._clock = clock
        self._expected: dict[str, dict[int, float]] = defaultdict(dict)  # worker -> key -> until
        self._pending_tokens: dict[str, int] = defaultdict(int)
        self._pending_blocks: dict[str, int] = defaultdict(int)
        # (prefill id and address, decode id, address and receivers) -> transport -> why it
        # failed. A worker that restarts comes back at a new address or with new receivers, so
        # its past failures do not count against it.
        self._broken: dict[tuple[str, ...], dict[str, str]] = {}
        self._lock = threading.Lock()

    def transport(self, prefill: Worker, decode: Worker) -> str:
        """The transport KV goes by from `prefill` to `decode`, chosen here once per placed pair
        and sent with the request (TransportRefused when none can work)."""
        return choose_transport(prefill.kv_place(), decode.kv_place(),
                                self._broken.get(_pair(prefill, decode)))

    def refusal(self, prefill: Worker, decode: Worker) -> str | None:
        """Why KV cannot go from `prefill` to `decode` (None: it can)."""
        try:
            self.transport(prefill, decode)
        except TransportRefused as exc:
            return str(exc)
        return None

    def mark_broken(self, prefill: Worker, decode: Worker, transport: str, reason: str) -> None:
        """A transfer between the two by `transport` failed in a way that would repeat: the
        pair's next transfers go by another transport if one can work, else the pair is
        refused."""
        self._broken.setdefault(_pair(prefill, decode), {})[transport] = reason

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

    # ---- prefix caches ---------------------------------------------------------------------
    def cached_tokens(self, worker: Worker, keys: Sequence[int], prompt_tokens: int) -> int:
        """How many leading tokens of the prompt (whose full blocks have `keys`) the worker's
        prefix cache holds, as far as the router knows; at most prompt_tokens - 1 (the last
        token is always computed)."""
        if not self.cache_aware or not keys:
            return 0
        expected = self._expected.get(worker.worker_id, {})
        now = self._clock()
        held = 0
        for key in keys:
            if key not in worker.prefix_hashes and expected.get(key, 0.0) <= now:
                break
            held += 1
        return min(held * worker.block_size, prompt_tokens - 1)

    def expect(self, worker_id: str, keys: Sequence[int]) -> None:
        """The worker was given this prompt: count its blocks as cached there for a while."""
        if not self.cache_aware or not keys:
            return
        with self._lock:
            now = self._clock()
            expected = self._expected[worker_id]
            for key in [k for k, until in expected.items() if until <= now]:
                del expected[key]
            until = now + EXPECT_S
            expected.update((key, until) for key in keys)

    def prefill_work(self, worker: Worker, keys: Sequence[int], prompt_tokens: int) -> int:
        """Prefill tokens the worker would compute before this prompt's are done."""
        return self.queued_tokens(worker) + prompt_tokens - \
            self.cached_tokens(worker, keys, prompt_tokens)

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """A prompt's block keys, as the workers' prefix caches name them ([] when not
        cache-aware, or no worker is known yet)."""
        workers = self.registry.snapshot()
        if not workers or not self.cache_aware:
            return []
        return prefix_hashes(token_ids, workers[0].block_size)

    def site_inputs(self, prompt_tokens: int, decode: Worker, exclude: frozenset[str],
                    keys: Sequence[int]) -> SiteInputs:
        """What deciding where to prefill a prompt placed on `decode` needs."""
        pool = [self.prefill_work(w, keys, prompt_tokens)
                for w in self.prefill_candidates(exclude, (Role.PREFILL,), decode)]
        return SiteInputs(prompt_tokens, self.cached_tokens(decode, keys, prompt_tokens),
                          self.queued_tokens(decode), min(pool) if pool else None,
                          decode.prefill_chunk_tokens)

    # ---- placing ---------------------------------------------------------------------------
    def prefill_candidates(self, exclude: frozenset[str], roles: tuple[Role, ...],
                           decode: Worker | None) -> list[Worker]:
        return [w for w in self.registry.placeable(lambda r: r in roles)
                if w.worker_id not in exclude
                and (decode is None or self.refusal(w, decode) is None)]

    def place_prefill(self, prompt_tokens: int, exclude: frozenset[str] = frozenset(),
                      roles: tuple[Role, ...] = (Role.PREFILL, Role.COLOCATED),
                      decode: Worker | None = None, keys: Sequence[int] = ()
                      ) -> tuple[Worker, Charge] | None:
        """The prefill worker that would finish the prompt first (`prefill_work`; ties: fewest
        running) among those that can send KV to `decode`."""
        with self._lock:
            candidates = self.prefill_candidates(exclude, roles, decode)
            if not candidates:
                return None
            best = min(candidates, key=lambda w: (self.prefill_work(w, keys, prompt_tokens),
                                                  w.load.running_requests, w.worker_id))
            work = prompt_tokens - self.cached_tokens(best, keys, prompt_tokens)
            self._pending_tokens[best.worker_id] += work
        self.expect(best.worker_id, keys)
        return best, Charge(best.worker_id, prompt_tokens=work)

    def place_decode(self, total_tokens: int, exclude: frozenset[str] = frozenset(),
                     roles: tuple[Role, ...] = (Role.DECODE, Role.COLOCATED),
                     paired: bool = False, keys: Sequence[int] = ()
                     ) -> tuple[Worker, Charge] | None:
        """The decode worker with the most free blocks, counting the prompt's blocks (`keys`)
        it caches already, among those that can hold `total_tokens` (prompt + max_tokens) of
        KV (and, if `paired`, that some prefill worker can send KV to); None when none can.
        The caller `expect`s the keys there once it knows the worker keeps the request."""
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
            best, need = max(fits, key=lambda item: (
                self.free_blocks(item[0]) + self.cached_tokens(item[0], keys, total_tokens)
                // item[0].block_size, item[0].worker_id))
            self._pending_blocks[best.worker_id] += need
        return best, Charge(best.worker_id, blocks=need)

    def charge_decode(self, worker: Worker, total_tokens: int) -> Charge:
        """Count the blocks of a request given to a decode worker outside place_decode (a sample
        forking from another's prompt there)."""
        need = -(-total_tokens // worker.block_size)
        with self._lock:
            self._pending_blocks[worker.worker_id] += need
        return Charge(worker.worker_id, blocks=need)

    def charge_prefill(self, worker: Worker, prompt_tokens: int) -> Charge:
        """Count prefill work given to a worker outside place_prefill (a local prefill)."""
        with self._lock:
            self._pending_tokens[worker.worker_id] += prompt_tokens
        return Charge(worker.worker_id, prompt_tokens=prompt_tokens)

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
    # The receivers' id is new in every decode process, even one restarted on the same port.
    return (prefill.worker_id, prefill.address, decode.worker_id, decode.address,
            decode.kv_receiver_id)


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
