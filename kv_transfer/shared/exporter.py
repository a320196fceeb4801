"""The shared transport's decode side: export this worker's cache to writers on this host, one
thread per mapping, each write admitted, ended and cleaned up through the worker's
ReservationBook (the protocol: kv_transfer.shared)."""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import socket
import threading

from engine.kv_memory import KVShards
from engine.omp_threads import use_one_torch_thread
from kv_transfer.connector import ReservationBook, Write
from kv_transfer.device import device_identity
from kv_transfer.errors import TransferStats
from kv_transfer.shared.mapping import (
    HANDSHAKE_TIMEOUT_S,
    check_same_user,
    recv_frame,
    send_cache,
    send_frame,
    wait_until_dead,
)

log = logging.getLogger(__name__)
WRITER_EXIT_TIMEOUT_S = 30.0  # a writer that closed without a goodbye: wait for its exit
TRANSPORT = "shared"


class KVExporter:
    """Exports this worker's cache to writers on this host, one thread per mapping."""

    def __init__(self, worker_id: str, cache: KVShards, book: ReservationBook):
        if cache.primary.device.type == "cpu" and any(b.fd is None for b in cache.buffers):
            raise ValueError("a CPU KV cache must be allocated shareable to be exported")
        self.cache = cache
        self.book = book
        self.name = f"pdserve-kv-{worker_id}-{secrets.token_hex(4)}"
        self.address = f"@{self.name}"  # "@": an abstract socket name, as `ss` shows it
        self.device = device_identity(cache.primary.device)
        self._ids = itertools.count(1)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(64)
        self._closed = False
        threading.Thread(target=self._accept, name="kv-export", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
        except OSError:
            pass
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-export-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        use_one_torch_thread()
        mapping_id, key, pid = next(self._ids), "", 0
        said_bye = False
        try:
            with conn:
                pid = check_same_user(conn)
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                key = f"{json.loads(recv_frame(conn))['writer']}#{mapping_id}"
                send_cache(conn, mapping_id, self.cache, self.device)
                conn.settimeout(None)
                said_bye = self._answer_until_closed(conn, key)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # TypeError, AttributeError: a frame of the wrong shape (a list, a null count); the
            # writes of this mapping must still end below.
            log.warning("KV export mapping %s ended: %s", key or mapping_id, exc)
        if key and (said_bye or self._writer_exited(key, pid)):
            self.book.writer_gone(key)

    def _answer_until_closed(self, conn: socket.socket, key: str) -> bool:
        """Serve the writer's begin/finish requests until it closes; True if it said bye."""
        while True:
            try:
                message = json.loads(recv_frame(conn))
            except (OSError, ValueError):  # closed or reset without a goodbye
                return False
            if message["op"] == "bye":
                return True
            send_frame(conn, json.dumps(self._answer(key, message)).encode())

    def _answer(self, key: str, message: dict) -> dict:
        try:
            if message["op"] == "begin":
                self.book.admit(Write(TRANSPORT, key, message["request_id"],
                                      int(message["num_blocks"]), message["dtype"],
                                      str(message.get("secret", ""))))
                return {"ok": True}
            if message["op"] == "finish":
                ok = bool(message["ok"])
                stats = TransferStats(int(message["num_bytes"]), float(message["seconds"]),
                                      TRANSPORT) if ok else None
                write = Write(TRANSPORT, key, message["request_id"], 0, "", "")
                return {"held": self.book.complete(write, ok, stats)}
            return {"error": f"unknown op {message['op']!r}"}
        except (KeyError, ValueError, TypeError, PermissionError) as exc:
            return {"error": str(exc)[:500]}

    def _writer_exited(self, key: str, pid: int) -> bool:
        """The writer vanished without a goodbye: it died. On CPU nothing of its can land after
        that; a dying process's queued GPU copies end with its CUDA context, not its socket, so
        on a GPU wait until it has finished exiting — and if that cannot be seen (a pid hidden by
        another pid namespace, or still exiting after the timeout), keep its blocks reserved:
        leaking them is safe, reusing them is not."""
        if self.cache.primary.device.type != "cuda" or wait_until_dead(pid,
                                                                       WRITER_EXIT_TIMEOUT_S):
            return True
        log.error("mapping %s closed without a goodbye and writer pid %d was not seen to exit "
                  "within %.0fs: the blocks it was writing stay reserved", key, pid,
                  WRITER_EXIT_TIMEOUT_S)
        return False
