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


def allocate_kv_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                       shareable: bool = False) -> KVBuffer:
    """A zero-filled cache of `shape` (layers first): never-written slots hold finite values, as
    the torch attention path masks rather than skips them."""
    if device.type != "cpu" or not shareable:
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        return KVBuffer(tensor, list(tensor.unbind(0)))
    num_bytes = math.prod(shape) * dtype.itemsize
    fd = os.memfd_create("pdserve-kv-cache", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, num_bytes)  # a fresh memfd reads as zeros
        # Populated now, not page by page inside the first requests' writes.
        mapping = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except OSError:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=dtype).view(shape)
    return KVBuffer(tensor, list(tensor.unbind(0)), fd, mapping)
