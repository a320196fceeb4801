"""The shared transport's socket side: the handshake that hands a peer this worker's cache (the
protocol is in kv_transfer.shared), and a writer's live mapping of a peer's cache."""

from __future__ import annotations

import json
import os
import pickle
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.kv_memory import KVBuffer, KVShards, map_kv_buffer

HANDSHAKE_TIMEOUT_S = 5.0
MAX_RANKS = 64  # the most rank buffers (file descriptors) one export hands over
_LENGTH = struct.Struct("!I")


@dataclass
class PeerMapping:
    """A live mapping of one decode worker's cache."""

    address: str
    mapping_id: int
    cache: KVShards  # the peer's whole cache: each rank's [layers, 2, blocks, block_size, h, d]
    conn: socket.socket
    keep: object = None  # what keeps the memory mapped (the mmap of a CPU cache)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one write at a time

    def call(self, message: dict, timeout_s: float) -> dict:
        """One control exchange with the exporter (OSError/ValueError when the peer is gone or
        slow: the mapping must then be dropped)."""
        self.conn.settimeout(timeout_s)
        send_frame(self.conn, json.dumps(message).encode())
        return json.loads(recv_frame(self.conn))

    def alive(self) -> bool:
        """False once the peer closed its end (it died or stopped exporting). Polls without
        reading, so it is safe beside an exchange in flight on another thread."""
        poller = select.poll()
        try:
            poller.register(self.conn, select.POLLRDHUP)
        except (OSError, ValueError):  # closed here already
            return False
        gone = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
        return not any(events & gone for _, events in poller.poll(0))


def map_peer(worker_id: str, address: str, like: KVShards, timeout_s: float) -> PeerMapping:
    """Connect to a decode worker's export and map its cache (checked against ours: same layer
    count, block size, KV heads, head size and dtype; each side may split the heads over its
    tensor-parallel ranks its own way). ValueError (or ConnectionRefusedError: no such export in
    this network namespace) when it can never work; other OSErrors may pass."""
    if not address.startswith("@"):
        raise ValueError(f"not an abstract Unix socket name: {address!r}")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(min(timeout_s, HANDSHAKE_TIMEOUT_S))
        conn.connect("\0" + address[1:])
        check_same_user(conn)  # whoever holds that name must be one of ours
        send_frame(conn, json.dumps({"writer": worker_id}).encode())
        header, fds = _recv_header(conn)
        cache, keep = _open_cache(header, fds, conn)
        if cache.layout() != like.layout():
            raise ValueError(f"the peer's cache is {cache.layout()}, ours {like.layout()}: "
                             "the layouts differ")
        conn.settimeout(None)
    except BaseException:
        _say_bye_and_close(conn)  # nothing was written through it
        raise
    return PeerMapping(address, int(header["mapping_id"]), cache, conn, keep)


def _say_bye_and_close(conn: socket.socket) -> None:
    try:
        send_frame(conn, json.dumps({"op": "bye"}).encode())
    except OSError:
        pass
    conn.close()


def _open_cache(header: dict, fds: list[int], conn: socket.socket) -> tuple[KVShards, object]:
    """The peer's cache, one buffer per rank (and what keeps CPU buffers mapped); ValueError
    for a header that does not describe one."""
    try:
        dtype = getattr(torch, header["dtype"])
        shards = [(tuple(int(n) for n in shard["shape"]), range(*shard["heads"]))
                  for shard in header["shards"]]
        kind, num_kv_heads = header["kind"], int(header["num_kv_heads"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"not a KV cache export header: {exc!r}") from exc
    heads = tuple(held for _, held in shards)
    if kind == "cpu-memfd":
        try:
            if len(fds) != len(shards):
                raise ValueError(f"expected {len(shards)} file descriptors, got {len(fds)}")
            buffers = [map_kv_buffer(os.dup(fd), shape, dtype)
                       for fd, (shape, _) in zip(fds, shards)]
        finally:
            for fd in fds:
                os.close(fd)
        for buffer in buffers:
            buffer.release()  # the mappings keep the memory; we export nothing of a peer's
        return KVShards(tuple(buffers), heads, num_kv_heads), buffers
    if kind == "cuda-ipc":
        buffers = []
        for _ in shards:
            rebuild, args = pickle.loads(recv_frame(conn))  # noqa: S301 - a same-uid peer
            # rebuild_cuda_tensor's 7th argument is the exporter's device index; this process
            # may number its GPUs differently (CUDA_VISIBLE_DEVICES): open the one with its UUID.
            args = (*args[:6], _local_gpu_index(header["device"]), *args[7:])
            tensor = rebuild(*args)
            buffers.append(KVBuffer(tensor, list(tensor.unbind(0))))
        return KVShards(tuple(buffers), heads, num_kv_heads), None
    raise ValueError(f"unknown export kind {kind!r}")


def _local_gpu_index(device: str) -> int:
    for index in range(torch.cuda.device_count()):
        if f"cuda:{torch.cuda.get_device_properties(index).uuid}" == device:
            return index
    raise ValueError(f"GPU {device} is not visible to this process")


def check_same_user(conn: socket.socket) -> int:
    """The peer's pid (0 when its pid namespace hides it); ValueError for another user."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise ValueError(f"the peer process runs as uid {uid}, not {os.getuid()}: refused")
    return pid


def wait_until_dead(pid: int, timeout_s: float) -> bool:
    """Wait until process `pid` has finished exiting (gone, or a zombie: every resource released,
    its GPU context included); False after `timeout_s` (or when its pid is hidden from us)."""
    if pid <= 0:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def send_frame(conn: socket.socket, body: bytes) -> None:
    conn.sendall(_LENGTH.pack(len(body)) + body)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ValueError("the peer closed the connection mid-message")
        data += chunk
    return bytes(data)


def recv_frame(conn: socket.socket) -> bytes:
    (length,) = _LENGTH.unpack(_recv_exact(conn, _LENGTH.size))
    return _recv_exact(conn, length)


def _recv_header(conn: socket.socket) -> tuple[dict, list[int]]:
    """The header frame, with any file descriptors sent alongside its length."""
    prefix, fds, _flags, _addr = socket.recv_fds(conn, _LENGTH.size, MAX_RANKS,
                                                 socket.MSG_CMSG_CLOEXEC)
    if len(prefix) < _LENGTH.size:
        prefix += _recv_exact(conn, _LENGTH.size - len(prefix))
    (length,) = _LENGTH.unpack(prefix)
    return json.loads(_recv_exact(conn, length)), list(fds)


def send_cache(conn: socket.socket, mapping_id: int, cache: KVShards, device: str) -> None:
    """The exporter's answer to a writer: the header, then the cache — every rank's buffer (its
    fd, or its CUDA IPC handle) and the KV heads it holds (at most MAX_RANKS buffers)."""
    if len(cache.buffers) > MAX_RANKS:
        raise ValueError(f"a cache of {len(cache.buffers)} rank buffers; at most {MAX_RANKS} "
                         "can be exported")
    shards = [{"shape": list(b.tensor.shape), "heads": [h.start, h.stop],
               "num_bytes": b.num_bytes} for b, h in zip(cache.buffers, cache.heads)]
    header = {"mapping_id": mapping_id, "dtype": str(cache.primary.dtype).removeprefix("torch."),
              "device": device, "num_kv_heads": cache.num_kv_heads, "shards": shards}
    if cache.primary.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        header["kind"] = "cuda-ipc"
        send_frame(conn, json.dumps(header).encode())
        for buffer in cache.buffers:
            send_frame(conn, pickle.dumps(reduce_tensor(buffer.tensor)))
        return
    fds = [b.fd for b in cache.buffers]
    if any(fd is None for fd in fds):
        raise ValueError("a CPU cache must live in memfds to be exported")
    header["kind"] = "cpu-memfd"
    body = json.dumps(header).encode()
    socket.send_fds(conn, [_LENGTH.pack(len(body))], fds)
    conn.sendall(body)
