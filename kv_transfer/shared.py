"""The shared transport: one-sided copies into a peer's KV cache on the same host (this module:
the protocol, the copy and the decode side; kv_transfer.shared_sender: the prefill side).

Protocol (decode worker D exports, prefill worker P writes):
1. D allocates its whole cache as one buffer (engine.kv_memory: a memfd on CPU, any CUDA
   allocation on a GPU) and listens on a Unix socket with an abstract name (no file to leak; it
   vanishes with the process), which its registration carries as `kv_export_address`.
2. P connects once per D (a *mapping*): it sends its worker id; D answers with a header (mapping
   id, layout, dtype, device) and the cache itself — the memfd as an SCM_RIGHTS file descriptor,
   or the CUDA IPC handle torch.multiprocessing builds. P maps it; no staging buffer, no NCCL, no
   per-pair rendezvous. Only a process of the same user may connect (SO_PEERCRED).
3. Per request, over the same socket (one JSON frame each way, microseconds on one host): P asks
   D to admit a write into the request's reserved blocks (`begin`); D marks the reservation as
   being written by this mapping, or refuses. P copies the blocks (contiguous runs of block ids,
   all layers per run, device to device on GPUs), waits for the copy to complete, then reports the
   end (`finish`, ok or not); D answers whether it still holds the request. Between `begin` and
   `finish` P may copy in several pieces (a long prompt's chunks as they are computed: the
   prefill worker's KV streaming); the blocks stay RECEIVING, so D frees none of them meanwhile.
4. The socket stays open while P may write through it: it is also D's liveness signal. P closes
   it only when none of its writes through the mapping is in flight, saying `bye` first; if P
   dies the kernel closes it, and D waits until P has finished exiting (its pid gone or a zombie:
   a dying process's queued GPU copies end with its CUDA context, not its socket). Either way D
   then ends every write the mapping had begun as failed and frees the blocks — never before
   (decode_worker.reservations states and enforces the invariant). One thread per mapping on D
   handles its begin, finish and close in order, so a write can never begin on a closed mapping.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.kv_memory import KVBuffer
from kv_transfer.shared_socket import (
    HANDSHAKE_TIMEOUT_S,
    check_same_user,
    recv_frame,
    send_cache,
    send_frame,
    wait_until_dead,
)

log = logging.getLogger(__name__)
WRITER_EXIT_TIMEOUT_S = 30.0  # a writer that closed without a goodbye: wait for its exit


def device_identity(device: torch.device) -> str:
    """"cpu", or "cuda:<GPU UUID>" (stable across processes, whatever their device numbering)."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) of the maximal runs where both id lists advance by one."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor,
                dst_ids: Sequence[int]) -> int:
    """Copy blocks between whole caches ([layers, 2, blocks, ...]) and wait until the copy is
    complete; returns the bytes copied."""
    try:
        for s, d, n in block_runs(src_ids, dst_ids):
            dst[:, :, d:d + n].copy_(src[:, :, s:s + n], non_blocking=True)
    finally:  # also after a failed launch: runs already queued must be done before we report
        for device in {src.device, dst.device}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    per_block = src[:, :, 0].numel() * src.element_size()
    return per_block * len(src_ids)


# ---- decode side ---------------------------------------------------------------------------

class WriteHandler(Protocol):
    """What the exporting worker does with its writers' requests (decode_worker.worker)."""

    def begin_write(self, writer: str, request_id: str, num_blocks: int, dtype: str,
                    secret: str = "") -> None:
        """Admit the write (KeyError/ValueError/PermissionError with the reason to refuse it):
        `secret` must be the reservation's transfer secret."""

    def end_write(self, writer: str, request_id: str, ok: bool, num_bytes: int,
                  seconds: float) -> bool:
        """The write ended; whether the request still holds its blocks."""

    def writer_gone(self, writer: str) -> None:
        """No write through this mapping can land any more."""


class KVExporter:
    """Exports this worker's cache to writers on this host, one thread per mapping."""

    def __init__(self, worker_id: str, buffer: KVBuffer, handler: WriteHandler):
        if buffer.tensor.device.type == "cpu" and buffer.fd is None:
            raise ValueError("a CPU KV cache must be allocated shareable to be exported")
        self.buffer = buffer
        self.handler = handler
        self.name = f"pdserve-kv-{worker_id}-{secrets.token_hex(4)}"
        self.address = f"@{self.name}"  # "@": an abstract socket name, as `ss` shows it
        self.device = device_identity(buffer.tensor.device)
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
        mapping_id, key, pid = next(self._ids), "", 0
        said_bye = False
        try:
            with conn:
                pid = check_same_user(conn)
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                key = f"{json.loads(recv_frame(conn))['writer']}#{mapping_id}"
                send_cache(conn, mapping_id, self.buffer.tensor, self.device, self.buffer.fd,
                           self.buffer.num_bytes)
                conn.settimeout(None)
                said_bye = self._answer_until_closed(conn, key)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("KV export mapping %s ended: %s", key or mapping_id, exc)
        if key and (said_bye or self._writer_exited(key, pid)):
            self.handler.writer_gone(key)

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
                self.handler.begin_write(key, message["request_id"], int(message["num_blocks"]),
                                         message["dtype"], str(message.get("secret", "")))
                return {"ok": True}
            if message["op"] == "finish":
                return {"held": self.handler.end_write(
                    key, message["request_id"], bool(message["ok"]),
                    int(message["num_bytes"]), float(message["seconds"]))}
            return {"error": f"unknown op {message['op']!r}"}
        except (KeyError, ValueError, PermissionError) as exc:
            return {"error": str(exc)[:500]}

    def _writer_exited(self, key: str, pid: int) -> bool:
        """The writer vanished without a goodbye: it died. On CPU nothing of its can land after
        that; a dying process's queued GPU copies end with its CUDA context, not its socket, so
        on a GPU wait until it has finished exiting — and if that cannot be seen (a pid hidden by
        another pid namespace, or still exiting after the timeout), keep its blocks reserved:
        leaking them is safe, reusing them is not."""
        if self.buffer.tensor.device.type != "cuda" or wait_until_dead(pid,
                                                                       WRITER_EXIT_TIMEOUT_S):
            return True
        log.error("mapping %s closed without a goodbye and writer pid %d was not seen to exit "
                  "within %.0fs: the blocks it was writing stay reserved", key, pid,
                  WRITER_EXIT_TIMEOUT_S)
        return False
