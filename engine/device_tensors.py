"""Host lists to device tensors without stalling the host on the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits for the stream to
drain: inside a step that is a host synchronisation in the middle of the GPU's work. From pinned
memory with `non_blocking=True` the copy is queued behind that work instead, and torch's pinned
allocator keeps the buffer alive until the copy has run. On CPU this is plain `torch.tensor`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
