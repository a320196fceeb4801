"""Reserved blocks waiting for a prompt's KV, each under a lease. Plain Python, thread-safe: the
KV control RPCs begin and end transfers on their own threads, without waiting for the engine loop
(which may be in the middle of a long step); `release` must therefore be safe from any thread —
the decode worker posts the actual freeing to the loop.

The invariant (one-sided writes make it matter): **a reservation's blocks are released only when
no write into them can still land.** A write begins with `begin_receive` (naming its writer:
empty for a transfer this worker receives itself, or the key of a peer's mapping of our cache for
a one-sided write) and the reservation is then RECEIVING. While RECEIVING, nothing frees the
blocks: an abort only marks the reservation, and the lease does not run. RECEIVING ends only by
`end_receive` (the writer reports it is done, well or not), `refuse_receive` (its bytes were
refused before any was written: RESERVED again) or `writer_gone` (the writer's mapping
closed: it let go of our cache with no write in flight, or it died) — and then an aborted or
failed reservation is freed. Blocks are taken fresh at reservation, never from the prefix cache,
so a write can only land in blocks that belong to that request alone.

A transfer may come in pieces (KV streamed while the prompt computes, dist transport): each piece
is a receive of its own that must start where the previous one ended (`received_blocks`); between
pieces the reservation is RESERVED again with its lease restarted, so a sender that vanishes
between pieces costs a lease, not a leak. Only the last piece makes it READY."""

from __future__ import annotations

import enum
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.request import Request


class LeaseState(enum.Enum):
    RESERVED = "reserved"  # blocks held, waiting for the KV transfer to start
    RECEIVING = "receiving"  # a transfer is writing into the blocks: they must not be freed
    READY = "ready"  # KV written, waiting for the Decode call that admits the request


@dataclass
class Reservation:
    request: Request
    lease_s: float
    expires_at: float
    state: LeaseState = LeaseState.RESERVED
    aborted: bool = False  # abort arrived while RECEIVING: free once the transfer is done
    writer: str = ""  # while RECEIVING: the mapping writing into the blocks ("" = ourselves)
    received_blocks: int = 0  # fresh blocks written by the pieces received so far
    secret: str = ""  # the router's transfer secret: a write must present it ("": none asked)


class ReservationTable:
    def __init__(self, release: Callable[[Request], None],
                 clock: Callable[[], float] = time.monotonic):
        self._release = release
        self._clock = clock
        self._table: dict[str, Reservation] = {}
        self._lock = threading.RLock()
        self.num_expired = 0

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._table

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    def add(self, request: Request, lease_s: float, secret: str = "") -> None:
        with self._lock:
            self._table[request.request_id] = Reservation(request, lease_s,
                                                          self._clock() + lease_s, secret=secret)

    def begin_receive(self, request_id: str, writer: str = "", first_block: int = 0,
                      secret: str = "") -> Request:
        """Pause the lease while a transfer (by `writer`, see the module doc) writes into the
        blocks, from fresh block `first_block` on (where the previous piece ended). Only a
        transfer presenting the reservation's secret may (PermissionError otherwise)."""
        with self._lock:
            reservation = self._get(request_id)
            if not hmac.compare_digest(secret.encode(), reservation.secret.encode()):
                raise PermissionError(f"request {request_id!r}: wrong transfer secret; only "
                                      f"the prefill worker the router placed may write")
            if reservation.state is not LeaseState.RESERVED:
                raise KeyError(f"request {request_id!r} is {reservation.state.value}, not reserved")
            if first_block != reservation.received_blocks:
                raise ValueError(f"first_block is {first_block}; request {request_id!r} has "
                                 f"received {reservation.received_blocks} blocks")
            reservation.state = LeaseState.RECEIVING
            reservation.writer = writer
            return reservation.request

    def writer_of(self, request_id: str) -> str | None:
        """The writer of a RECEIVING reservation (None when it is not being written)."""
        with self._lock:
            reservation = self._table.get(request_id)
            if reservation is None or reservation.state is not LeaseState.RECEIVING:
                return None
            return reservation.writer

    def writer_gone(self, writer: str) -> list[str]:
        """`writer`'s mapping closed: none of its writes can land any more. Every reservation it
        was writing ends as failed (blocks freed); returns their request ids."""
        with self._lock:
            ended = [rid for rid, r in self._table.items()
                     if r.state is LeaseState.RECEIVING and writer and r.writer == writer]
            for rid in ended:
                self._drop(rid)
            return ended

    def end_receive(self, request_id: str, ok: bool, more_after: int | None = None) -> bool:
        """The transfer finished. On success the lease restarts (the Decode call must follow,
        or with `more_after` — a piece of that many blocks — the next piece); on failure, or if
        an abort came meanwhile, the blocks are freed. True if still held."""
        with self._lock:
            reservation = self._get(request_id)
            if not ok or reservation.aborted:
                self._drop(request_id)
                return False
            if more_after is None:
                reservation.state = LeaseState.READY
            else:
                reservation.state = LeaseState.RESERVED
                reservation.received_blocks += more_after
            reservation.writer = ""
            reservation.expires_at = self._clock() + reservation.lease_s
            return True

    def refuse_receive(self, request_id: str) -> bool:
        """The transfer ended with nothing written (its bytes were refused): the reservation is
        RESERVED again as before it began, lease restarted — unless an abort came meanwhile,
        which frees the blocks now. True if still held."""
        with self._lock:
            reservation = self._get(request_id)
            if reservation.aborted:
                self._drop(request_id)
                return False
            reservation.state = LeaseState.RESERVED
            reservation.writer = ""
            reservation.expires_at = self._clock() + reservation.lease_s
            return True

    def take_ready(self, request_id: str) -> Request:
        """Hand a request whose KV has arrived to the scheduler (the table forgets it)."""
        with self._lock:
            reservation = self._get(request_id)
            if reservation.state is not LeaseState.READY:
                raise KeyError(f"request {request_id!r} has no KV yet ({reservation.state.value})")
            del self._table[request_id]
            return reservation.request

    def abort(self, request_id: str) -> bool:
        with self._lock:
            reservation = self._table.get(request_id)
            if reservation is None:
                return False
            if reservation.state is LeaseState.RECEIVING:
                reservation.aborted = True  # the writer still uses the blocks
            else:
                self._drop(request_id)
            return True

    def expire(self) -> list[str]:
        """Free reservations whose lease ran out (never while a transfer writes)."""
        with self._lock:
            now = self._clock()
            expired = [rid for rid, r in self._table.items()
                       if r.state is not LeaseState.RECEIVING and now >= r.expires_at]
            for rid in expired:
                self._drop(rid)
            self.num_expired += len(expired)
            return expired

    def requests(self) -> list[Request]:
        with self._lock:
            return [r.request for r in self._table.values()]

    def _get(self, request_id: str) -> Reservation:
        reservation = self._table.get(request_id)
        if reservation is None:
            raise KeyError(f"no reservation for request {request_id!r} (expired or aborted)")
        return reservation

    def _drop(self, request_id: str) -> None:
        self._release(self._table.pop(request_id).request)
