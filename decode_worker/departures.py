"""Running requests leaving this decode worker with their KV (live migration, ARCHITECTURE.md "A
running request moves").

A request asked to move is paused (`engine.pause`: out of the running batch at the next step
boundary); once no step in flight still computes it, it is detached and parked here — its blocks
held under a lease — and its Decode stream ends with a `Paused` marker after every token produced
here. Then exactly one of these ends it: MigrateOut ships its KV to the reservation the router made
on another decode worker and frees it after that worker's acknowledgement (or after the transfer
failed); a resuming Decode puts it back in the batch; an abort or the lease frees it.

Loop thread only (the worker calls in through `EngineLoop.call`); plain Python over requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.engine import LLMEngine
from engine.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Paused:
    """Ends a request's output stream here: it is parked, to move or to resume."""

    request_id: str


@dataclass
class Parked:
    request: Request
    expires_at: float


class Departures:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._leases: dict[str, float] = {}  # paused, not yet settled -> its lease
        self._parked: dict[str, Parked] = {}
        self._shipping: dict[str, Request] = {}

    def pause(self, engine: LLMEngine, request_ids: list[str], lease_s: float) -> list[str]:
        """Pause those of `request_ids` that can move now; the ids paused."""
        paused = []
        for request_id in request_ids:
            reason = engine.pause(request_id)
            if reason is None:
                self._leases[request_id] = lease_s
                paused.append(request_id)
            else:
                log.debug("request %s does not move: %s", request_id, reason)
        return paused

    def settle(self, engine: LLMEngine, hand_over: Callable[[str, Paused], None]) -> None:
        """Park the paused requests whose KV is settled, and end their streams."""
        now = self._clock()
        for request in engine.take_paused():
            rid = request.request_id
            self._parked[rid] = Parked(request, now + self._leases.pop(rid, 0.0))
            hand_over(rid, Paused(rid))
        if self._leases:  # finished or aborted while pausing
            self._leases = {rid: lease for rid, lease in self._leases.items()
                            if rid in engine.scheduler.requests}

    def expire(self, engine: LLMEngine) -> None:
        now = self._clock()
        for rid, parked in list(self._parked.items()):
            if parked.expires_at <= now:
                log.warning("parked request %s was neither moved nor resumed within its lease; "
                            "blocks freed", rid)
                del self._parked[rid]
                engine.release(parked.request)

    def peek(self, request_id: str) -> Request:
        """A parked request, left parked (KeyError: none parked by that id)."""
        parked = self._parked.get(request_id)
        if parked is None:
            raise KeyError(_not_parked(request_id))
        return parked.request

    def ship(self, request_id: str) -> Request:
        """A parked request whose KV is about to be sent (KeyError: none parked by that id)."""
        request = self._take(request_id)
        self._shipping[request_id] = request
        return request

    def shipped(self, engine: LLMEngine, request_id: str) -> None:
        """Its transfer ended, acknowledged or failed: nothing writes from its blocks now."""
        request = self._shipping.pop(request_id, None)
        if request is not None:
            engine.release(request)

    def resume(self, engine: LLMEngine, request_id: str) -> None:
        """A parked request that did not move decodes here again (KeyError: none parked)."""
        engine.resume(self._take(request_id))

    def abort(self, engine: LLMEngine, request_id: str) -> bool:
        """Free a parked request; one being shipped is freed when its transfer ends."""
        self._leases.pop(request_id, None)
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            engine.release(parked.request)
            return True
        return request_id in self._shipping

    def _take(self, request_id: str) -> Request:
        parked = self._parked.pop(request_id, None)
        if parked is None:
            raise KeyError(_not_parked(request_id))
        return parked.request

    def __len__(self) -> int:
        return len(self._parked) + len(self._shipping)


def _not_parked(request_id: str) -> str:
    return (f"request {request_id!r} is not parked on this worker (it was never paused here, "
            "moved already, or its lease ended)")
