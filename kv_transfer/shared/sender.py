"""The shared transport's prefill side: map each decode worker's exported cache once, then write
requests' KV into it (the protocol is in kv_transfer.shared).

A write is opened (`begin`), filled by any number of copies — all at the end of a prefill, or a
chunk's blocks at a time while later chunks compute — and closed (`finish`). Each step holds the
mapping's lock, so the mapping is never closed under a copy in flight, and several requests'
writes through one mapping may be open at once (the decode side ends them all if it closes).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence

from engine.kv_memory import KVShards
from kv_transfer.errors import TransferError, TransferStats
from kv_transfer.shared.copy import copy_blocks
from kv_transfer.shared.mapping import PeerMapping, map_peer, send_frame

log = logging.getLogger(__name__)


class SharedWrite:
    """One request's open write into a decode worker's reserved blocks."""

    def __init__(self, sender: SharedSender, mapping: PeerMapping, receiver_id: str,
                 request_id: str):
        self.sender = sender
        self.mapping = mapping
        self.receiver_id = receiver_id
        self.request_id = request_id
        self.num_bytes = 0
        self.copy_s = 0.0  # time spent copying, whenever it happened
        self.finished = False

    def copy(self, src: KVShards, src_ids: Sequence[int], dst_ids: Sequence[int],
             wait: bool = True) -> bool:
        """Copy `src_ids` of our cache into `dst_ids` of the receiver's; complete on return
        (TransferError: the write must then be finished as failed). With `wait` False, copy only
        if the mapping is free now (another write's exchange may wait on a slow peer); returns
        whether it copied."""
        if not src_ids:
            return True
        if not self.mapping.lock.acquire(blocking=wait):
            return False
        try:
            if self.mapping.conn.fileno() < 0:  # dropped: the receiver has ended this write
                raise TransferError(f"the mapping of {self.receiver_id}'s cache was closed")
            start = time.perf_counter()
            try:
                self.num_bytes += copy_blocks(src, src_ids, self.mapping.cache, dst_ids)
            except Exception as exc:  # noqa: BLE001 - any copy failure ends the write
                raise TransferError(f"copying KV into {self.receiver_id}'s cache: {exc}") from exc
            finally:
                self.copy_s += time.perf_counter() - start
        finally:
            self.mapping.lock.release()
        return True

    def finish(self, ok: bool) -> bool:
        """Close the write; whether the receiver still holds the request (it frees the blocks
        when `ok` is False). Once only: later calls return False."""
        if self.finished:
            return False
        self.finished = True
        with self.mapping.lock:
            reply = self.sender.call(self.mapping, self.receiver_id, {
                "op": "finish", "request_id": self.request_id, "ok": ok,
                "num_bytes": self.num_bytes if ok else 0, "seconds": self.copy_s if ok else 0})
        return bool(reply.get("held"))


class SharedSender:
    """Prefill side: one mapping per decode worker's export."""

    def __init__(self, worker_id: str, timeout_s: float, pause_in_write_s: float = 0.0):
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.pause_in_write_s = pause_in_write_s  # fault injection (tests): a slow writer
        self._mappings: dict[str, PeerMapping] = {}
        self._lock = threading.Lock()

    def begin(self, receiver_id: str, address: str, request_id: str, src: KVShards,
              num_blocks: int, secret: str = "") -> SharedWrite:
        """Ask the receiver to admit a write of `num_blocks` into the request's reservation,
        presenting its transfer `secret` (TransferError when refused or broken; `permanent`
        when its cache cannot be mapped)."""
        mapping = self._mapping(receiver_id, address, src)
        dtype = str(src.primary.dtype).removeprefix("torch.")
        with mapping.lock:
            self.call(mapping, receiver_id, {"op": "begin", "request_id": request_id,
                                             "num_blocks": num_blocks, "dtype": dtype,
                                             "secret": secret})
        return SharedWrite(self, mapping, receiver_id, request_id)

    def complete(self, write: SharedWrite, src: KVShards, src_ids: Sequence[int],
                 dst_ids: Sequence[int]) -> TransferStats:
        """Copy the write's last blocks and finish it (failed, if the copy failed)."""
        if self.pause_in_write_s:
            log.warning("fault injection: pausing %.1fs inside the write", self.pause_in_write_s)
            time.sleep(self.pause_in_write_s)
        try:
            write.copy(src, src_ids, dst_ids)
        except TransferError:
            write.finish(ok=False)
            raise
        if not write.finish(ok=True):
            raise TransferError(f"{write.receiver_id} dropped request {write.request_id} "
                                f"during the write")
        return TransferStats(write.num_bytes, write.copy_s, "shared")

    def send(self, receiver_id: str, address: str, request_id: str, src: KVShards,
             src_ids: Sequence[int], dst_ids: Sequence[int], secret: str = "") -> TransferStats:
        """Copy `src_ids` of our cache into `dst_ids` of the receiver's, in one write."""
        write = self.begin(receiver_id, address, request_id, src, len(dst_ids), secret)
        return self.complete(write, src, src_ids, dst_ids)

    def call(self, mapping: PeerMapping, receiver_id: str, message: dict) -> dict:
        """One exchange, under the mapping's lock; a broken or slow peer loses the mapping
        (closing it tells the peer that no write of ours is in flight: we hold the lock)."""
        try:
            reply = mapping.call(message, self.timeout_s)
        except (OSError, ValueError) as exc:
            self._drop(mapping)
            raise TransferError(f"{receiver_id} did not answer {message['op']}: {exc}") from exc
        if "error" in reply:
            raise TransferError(f"{receiver_id} refused {message['op']}: {reply['error']}")
        return reply

    def _mapping(self, receiver_id: str, address: str, like: KVShards) -> PeerMapping:
        self._prune()
        with self._lock:
            mapping = self._mappings.get(address)
            if mapping is not None:
                return mapping
            try:
                mapping = map_peer(self.worker_id, address, like, self.timeout_s)
            except (OSError, ValueError, RuntimeError) as exc:
                # No export by that name here (it died, or lives in another network namespace),
                # another layout, GPU or user: it will not work later either. A timeout or a
                # reset mid-handshake may.
                permanent = isinstance(exc, (ConnectionRefusedError, ValueError, RuntimeError))
                raise TransferError(f"cannot map {receiver_id}'s KV cache at {address}: {exc}",
                                    permanent=permanent) from exc
            self._mappings[address] = mapping
            return mapping

    def _prune(self) -> None:
        """Let go of the caches of peers that are gone (their memory stays mapped until then)."""
        with self._lock:
            dead = [m for m in self._mappings.values() if not m.alive()]
        for mapping in dead:
            with mapping.lock:
                self._drop(mapping)

    def _drop(self, mapping: PeerMapping) -> None:
        """Let go of a mapping. The caller holds its lock, and a copy returns only once it is
        complete, so no write of ours through it is in flight: say so (bye) and close."""
        with self._lock:
            if self._mappings.get(mapping.address) is mapping:
                del self._mappings[mapping.address]
        try:
            send_frame(mapping.conn, json.dumps({"op": "bye"}).encode())
        except OSError:
            pass  # the peer is gone already
        mapping.conn.close()

    def close(self) -> None:
        with self._lock:
            mappings = list(self._mappings.values())
        for mapping in mappings:
            with mapping.lock:  # never close under a write in flight
                self._drop(mapping)
