"""The shared transport's one data operation: copying blocks between two whole caches mapped in
this process (ours and a peer's), in contiguous runs of block ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
