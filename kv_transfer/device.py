"""Where a KV cache lives, as a worker's registration tells the router (kv_transfer.selection)."""

from __future__ import annotations

import torch


def device_identity(device: torch.device) -> str:
    """"cpu", or "cuda:<GPU UUID>" (stable across processes, whatever their device numbering)."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"
