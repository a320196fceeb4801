"""A cache split over tensor-parallel ranks, as the KV transports see it (engine.kv_memory's
KVShards): blocks copied (shared transport) and packed/unpacked (dist transport) between every
pair of splits land exactly the model's heads where the other side holds them."""

from __future__ import annotations

import pytest
import torch

from engine.kv_memory import KVBuffer, KVShards
from kv_transfer.dist.packing import pack_blocks, packed_shapes, unpack_blocks
from kv_transfer.shared.copy import copy_blocks

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 2, 12, 4, 8
SRC_BLOCKS, DST_BLOCKS = [3, 4, 5, 9, 1], [10, 11, 2, 0, 7]
SPLITS = {  # the model's KV heads held by each rank's buffer
    "tp1": [range(4)],
    "tp2": [range(0, 2), range(2, 4)],
    "tp4": [range(0, 1), range(1, 2), range(2, 3), range(3, 4)],
    "uneven": [range(0, 1), range(1, 4)],
}
REPLICATED = {"tp1": [range(2)], "tp4": [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]}


def model_cache(heads: int, seed: int = 0) -> torch.Tensor:
    """Every head of every block, as a TP-1 engine would hold it."""
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, heads, HEAD_DIM)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def split(full: torch.Tensor, heads: list[range]) -> KVShards:
    buffers = []
    for held in heads:
        tensor = full[..., held.start:held.stop, :].clone()
        buffers.append(KVBuffer(tensor, list(tensor.unbind(0))))
    return KVShards(tuple(buffers), tuple(heads), full.shape[4])


def joined(cache: KVShards) -> torch.Tensor:
    """The model's view back from the buffers, checking replicas agree."""
    full = torch.full((LAYERS, 2, BLOCKS, BLOCK_SIZE, cache.num_kv_heads, HEAD_DIM), float("nan"))
    for buffer, held in zip(cache.buffers, cache.heads):
        part = full[..., held.start:held.stop, :]
        seen = ~part.isnan()
        assert torch.equal(part[seen], buffer.tensor[seen])  # replicas hold the same values
        part.copy_(buffer.tensor)
    return full


def cases(table: dict) -> list[tuple[list[range], list[range]]]:
    return [(table[a], table[b]) for a in table for b in table]


@pytest.mark.parametrize(("src_heads", "dst_heads"), cases(SPLITS) + cases(REPLICATED))
def test_copy_and_pack_move_each_head_to_where_the_other_side_holds_it(src_heads, dst_heads):
    heads = src_heads[-1].stop
    full = model_cache(heads)
    expected = torch.zeros_like(full)
    expected[:, :, DST_BLOCKS] = full[:, :, SRC_BLOCKS]

    copied = split(torch.zeros_like(full), dst_heads)
    written = copy_blocks(split(full, src_heads), SRC_BLOCKS, copied, DST_BLOCKS)
    assert torch.equal(joined(copied), expected)
    # the model's bytes, each head once, however many ranks replicate it
    assert written == len(SRC_BLOCKS) * LAYERS * 2 * BLOCK_SIZE * heads * HEAD_DIM * 4

    packed = pack_blocks(split(full, src_heads), SRC_BLOCKS)
    received = split(torch.zeros_like(full), dst_heads)
    assert [p.shape for p in packed] == packed_shapes(received, len(DST_BLOCKS))
    assert all(torch.equal(p, full[layer][:, SRC_BLOCKS]) for layer, p in enumerate(packed))
    unpack_blocks(received, DST_BLOCKS, packed)
    assert torch.equal(joined(received), expected)


def test_a_split_that_misses_a_head_or_mismatches_its_buffer_is_refused():
    half = model_cache(2)
    buffer = KVBuffer(half, list(half.unbind(0)))
    assert KVShards((buffer,), (range(0, 2),), 2).num_kv_heads == 2
    with pytest.raises(ValueError, match=r"hold KV heads \[0, 1\], not all 4"):
        KVShards((buffer,), (range(0, 2),), 4)
    with pytest.raises(ValueError, match="a buffer of 2 KV heads cannot hold heads 0..2"):
        KVShards((buffer,), (range(0, 3),), 4)


def test_layout_names_what_a_peer_must_match_whatever_its_split():
    full = model_cache(4)
    assert split(full, SPLITS["tp1"]).layout() == split(full, SPLITS["tp4"]).layout() == {
        "layers": LAYERS, "block_size": BLOCK_SIZE, "kv_heads": 4, "head_dim": HEAD_DIM,
        "dtype": "float32"}
    assert split(full, SPLITS["tp2"]).block_bytes == LAYERS * 2 * BLOCK_SIZE * 4 * HEAD_DIM * 4
