"""Host lists to device tensors without stalling the host on the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits for the stream to
drain: inside a step that is a host synchronisation in the middle of the GPU's work. From pinned
memory with `non_blocking=True` the copy is queued behind that work instead, and torch's pinned
allocator keeps the buffer alive until the copy has run. On CPU the host tensor is the result.

The lists become arrays through numpy, not `torch.tensor`: reading a list of Python ints takes
numpy about a quarter of torch's time (8,192 ints: ~0.1 ms against ~0.4 ms on a 2-core Xeon), and
a step builds several such lists (`benchmarks/host_step.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                 torch.bool: np.bool_}


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `values` (a flat or rectangular nested list)."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_dtype))


def padded_host_tensor(rows: Sequence[Sequence[int]], width: int, dtype: torch.dtype
                       ) -> torch.Tensor:
    """A CPU tensor [len(rows), width] of integer rows, each padded with zeros to `width` (no
    row is longer): read as one flat array and scattered, not padded row by row in Python."""
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), _NUMPY_DTYPES[dtype],
                       int(lengths.sum()))
    table = np.zeros((len(rows), width), _NUMPY_DTYPES[dtype])
    table[np.arange(width) < lengths[:, None]] = flat
    return torch.from_numpy(table)


def moved(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (itself on CPU; queued from pinned memory on CUDA)."""
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return moved(host_tensor(values, dtype), device)
