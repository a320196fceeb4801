"""The shared transport's one data operation: copying blocks between two whole caches mapped in
this process (ours and a peer's), in contiguous runs of block ids — and, where the two split the
KV heads over their tensor-parallel ranks differently, each destination rank's heads from the
source rank that holds them (kv_transfer.heads)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_memory import KVShards
from kv_transfer.heads import head_routes


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


def copy_blocks(src: KVShards, src_ids: Sequence[int], dst: KVShards,
                dst_ids: Sequence[int]) -> int:
    """Copy blocks between whole caches (every buffer [layers, 2, blocks, block_size, heads, d])
    and wait until the copy is complete; returns the model's bytes moved (every KV head once,
    as the dist transport counts them, however many ranks replicate a head)."""
    runs = block_runs(src_ids, dst_ids)
    routes = head_routes(src.heads, dst.heads)
    devices = {b.tensor.device for b in (*src.buffers, *dst.buffers)}
    try:
        for route in routes:
            s_heads = slice(route.src_start, route.src_start + route.count)
            d_heads = slice(route.dst_start, route.dst_start + route.count)
            source, target = src.buffers[route.src].tensor, dst.buffers[route.dst].tensor
            for s, d, n in runs:
                target[:, :, d:d + n, :, d_heads].copy_(source[:, :, s:s + n, :, s_heads],
                                                        non_blocking=True)
    finally:  # also after a failed launch: runs already queued must be done before we report
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    return dst.block_bytes * len(src_ids)
