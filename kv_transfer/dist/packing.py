"""Per-layer block packing: a request's KV blocks gathered into one contiguous tensor per layer,
holding every KV head of the model in order, whatever the tensor-parallel split on either side
(each rank's heads gathered on packing, and scattered to the ranks that hold them on unpacking:
kv_transfer.heads). The wire format is the same for every pair of TP sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_memory import KVShards
from kv_transfer.heads import head_routes


def packed_shapes(cache: KVShards, num_blocks: int) -> list[torch.Size]:
    """Shape of each layer's packed tensor: [2, num_blocks, block_size, kv_heads, head_dim]."""
    layers, _, _, block_size, _, head_dim = cache.primary.shape
    return [torch.Size((2, num_blocks, block_size, cache.num_kv_heads, head_dim))] * layers


def pack_blocks(cache: KVShards, block_ids: Sequence[int]) -> list[torch.Tensor]:
    """One contiguous [2, n, block_size, kv_heads, head_dim] tensor per layer (K and V)."""
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.primary.device)
    routes = head_routes(cache.heads, [range(cache.num_kv_heads)])
    packed = []
    for layer in range(cache.primary.shape[0]):
        parts = [cache.buffers[r.src].layers[layer][..., r.src_start:r.src_start + r.count, :]
                 for r in routes]
        if len(parts) == 1:
            packed.append(parts[0].index_select(1, index))
        else:
            packed.append(torch.cat([part.index_select(1, index) for part in parts], dim=3))
    return packed


def unpack_blocks(cache: KVShards, block_ids: Sequence[int],
                  packed: Sequence[torch.Tensor]) -> None:
    """Write packed layers into this worker's cache at `block_ids` (the receiver's own ids),
    each rank's buffer getting the heads it holds."""
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.primary.device)
    routes = head_routes([range(cache.num_kv_heads)], cache.heads)
    for layer, received in enumerate(packed):
        for r in routes:
            target = cache.buffers[r.dst].layers[layer]
            heads = received[..., r.src_start:r.src_start + r.count, :]
            if r.count == target.shape[3]:
                target.index_copy_(1, index, heads)
            else:
                target[..., r.dst_start:r.dst_start + r.count, :].index_copy_(1, index, heads)
