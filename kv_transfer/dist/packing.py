"""Per-layer block packing: a request's KV blocks gathered into one contiguous tensor per layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def packed_shapes(kv_caches: Sequence[torch.Tensor], num_blocks: int) -> list[torch.Size]:
    """Shape of each layer's packed tensor: [2, num_blocks, block_size, n_kv_heads, head_dim]."""
    return [torch.Size((2, num_blocks, *cache.shape[2:])) for cache in kv_caches]


def pack_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """One contiguous [2, n, block_size, n_kv, head_dim] tensor per layer (K and V together)."""
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=kv_caches[0].device)
    return [cache.index_select(1, index) for cache in kv_caches]


def unpack_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                  packed: Sequence[torch.Tensor]) -> None:
    """Write packed layers into this worker's cache at `block_ids` (the receiver's own ids)."""
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=kv_caches[0].device)
    for cache, layer in zip(kv_caches, packed):
        cache.index_copy_(1, index, layer)
