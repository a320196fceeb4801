"""Where the paged KV cache lives: one buffer for every layer, so another process on this host can
map the whole cache at once (kv_transfer's shared transport writes a request's blocks into it).

CPU: a shareable cache lives in an anonymous memfd (no name in /dev/shm, so nothing can leak: the
memory goes when the last process that maps it does); the fd is handed to a peer over a Unix socket.
CUDA: any allocation can be exported by IPC handle (torch.multiprocessing knows how), so the
shareable flag changes nothing there.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import torch


@dataclass
class KVBuffer:
    """The cache of every layer: `tensor` is [num_layers, 2, num_blocks, block_size, n_kv, d];
    `layers[i]` is layer i's [2, num_blocks, block_size, n_kv, d] view of it."""

    tensor: torch.Tensor
    layers: list[torch.Tensor]
    fd: int | None = None  # the memfd holding a shareable CPU cache
    mapping: mmap.mmap | None = None

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def release(self) -> None:
        """Close the memfd (the memory goes once no process maps it any more)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def allocate_kv_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                       shareable: bool = False) -> KVBuffer:
    """A zero-filled cache of `shape` (layers first): never-written slots hold finite values, as
    the torch attention path masks rather than skips them."""
    if device.type != "cpu" or not shareable:
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        return KVBuffer(tensor, list(tensor.unbind(0)))
    fd = os.memfd_create("pdserve-kv-cache", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, math.prod(shape) * dtype.itemsize)  # a fresh memfd reads as zeros
    except OSError:
        os.close(fd)
        raise
    return map_kv_buffer(fd, shape, dtype)


def map_kv_buffer(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> KVBuffer:
    """Map a shareable CPU cache (our own new memfd, or another process's received over a
    socket) into this process; the buffer keeps the fd, so this process can export it in turn.
    The fd is closed if it cannot be mapped."""
    num_bytes = math.prod(shape) * dtype.itemsize
    try:
        if os.fstat(fd).st_size != num_bytes:
            raise ValueError(f"the cache's memfd holds {os.fstat(fd).st_size} bytes, a "
                             f"{shape} {dtype} cache is {num_bytes}")
        # Populated now, not page by page inside the first requests' writes.
        mapping = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=dtype).view(shape)
    return KVBuffer(tensor, list(tensor.unbind(0)), fd, mapping)


@dataclass(frozen=True)
class KVShards:
    """A worker's whole KV cache as its transports see it: each rank's buffer with the model's
    KV heads it holds. An engine of one rank has one buffer holding every head; under tensor
    parallelism rank 0 maps every rank's buffer (engine.tp_ranks), and a KV head that the ranks
    replicate (fewer KV heads than ranks) is held by several buffers."""

    buffers: tuple[KVBuffer, ...]
    heads: tuple[range, ...]  # buffers[i] holds the model's KV heads heads[i], in order
    num_kv_heads: int  # the model's

    def __post_init__(self) -> None:
        if len(self.buffers) != len(self.heads) or not self.buffers:
            raise ValueError(f"{len(self.buffers)} buffers for {len(self.heads)} head ranges")
        for buffer, heads in zip(self.buffers, self.heads):
            if buffer.tensor.shape[4] != len(heads) or heads.stop > self.num_kv_heads:
                raise ValueError(f"a buffer of {buffer.tensor.shape[4]} KV heads cannot hold "
                                 f"heads {heads.start}..{heads.stop - 1} of {self.num_kv_heads}")
        held = set().union(*(set(h) for h in self.heads))
        if held != set(range(self.num_kv_heads)):
            raise ValueError(f"the buffers hold KV heads {sorted(held)}, not all "
                             f"{self.num_kv_heads}")

    @classmethod
    def whole(cls, buffer: KVBuffer) -> KVShards:
        """One buffer holding every KV head (an engine of one rank)."""
        heads = buffer.tensor.shape[4]
        return cls((buffer,), (range(heads),), heads)

    @property
    def primary(self) -> torch.Tensor:
        return self.buffers[0].tensor

    def layout(self) -> dict[str, object]:
        """What a peer's cache must match for blocks to move between us, whatever either's
        tensor-parallel split: layers, block size, KV heads, head size and dtype."""
        layers, _, _, block_size, _, head_dim = self.primary.shape
        return {"layers": layers, "block_size": block_size, "kv_heads": self.num_kv_heads,
                "head_dim": head_dim, "dtype": str(self.primary.dtype).removeprefix("torch.")}

    def layout_text(self) -> str:
        """`layout` as one line ("layers=30 block_size=16 kv_heads=3 ..."): what a worker's
        registration tells the router, which compares it with its peers'."""
        return " ".join(f"{key}={value}" for key, value in self.layout().items())

    @property
    def block_bytes(self) -> int:
        """One block of every layer and KV head, K and V: what a block costs on the wire."""
        layers, two, _, block_size, _, head_dim = self.primary.shape
        return (layers * two * block_size * self.num_kv_heads * head_dim
                * self.primary.element_size())
