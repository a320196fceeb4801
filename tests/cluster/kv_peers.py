"""Process bodies for the KV-transfer tests (importable by spawned children)."""

from __future__ import annotations

import torch

from kv_transfer import PairRegistry, TransferError, pack_blocks, packed_shapes, unpack_blocks
from kv_transfer.pair import RECEIVER_RANK, SENDER_RANK, connect_store, host_store

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 16, 4, 2, 8
SRC_BLOCKS, DST_BLOCKS = [3, 7, 1, 12], [10, 2, 5, 0]
TIMEOUT_S = 2.0


def make_caches(seed: int | None) -> list[torch.Tensor]:
    shape = (2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(LAYERS)]


def expected_checksum() -> float:
    caches = make_caches(seed=1)
    return float(sum(layer.double().sum() for layer in pack_blocks(caches, SRC_BLOCKS)))


def receiver(queue, plan: list[str]) -> None:
    """For each step of `plan`: 'recv' a transfer, or 'timeout' (expect none to arrive)."""
    from kv_transfer import receive_blocks

    store = host_store("127.0.0.1", 0)
    queue.put(("port", store.port))
    registry = PairRegistry(RECEIVER_RANK, torch.device("cpu"), "127.0.0.1")
    caches = make_caches(seed=None)
    for generation, step in enumerate(plan):
        pair = registry.get(store, "p->d", generation)
        try:
            layers, stats = receive_blocks(pair, tag=generation,
                                           shapes=packed_shapes(caches, len(DST_BLOCKS)),
                                           dtype=torch.float32, timeout_s=TIMEOUT_S)
        except TransferError as exc:
            registry.tear_down("p->d")
            queue.put(("error", step, str(exc)[:200]))
            continue
        unpack_blocks(caches, DST_BLOCKS, layers)
        received = pack_blocks(caches, DST_BLOCKS)
        queue.put(("ok", step, float(sum(t.double().sum() for t in received)), stats.num_bytes))


def sender(port: int, plan: list[str], first_generation: int = 0) -> None:
    """'send' a transfer, 'timeout' (never send), or 'die' (send one layer, then the process
    dies mid-transfer as a SIGKILL would leave it: no goodbye to the peer)."""
    import os

    from kv_transfer import send_blocks

    store = connect_store(f"127.0.0.1:{port}")
    registry = PairRegistry(SENDER_RANK, torch.device("cpu"), "127.0.0.1")
    caches = make_caches(seed=1)
    for generation, step in enumerate(plan, start=first_generation):
        pair = registry.get(store, "p->d", generation)
        if step == "timeout":
            continue  # never send: the receiver must give up on its own
        layers = pack_blocks(caches, SRC_BLOCKS)
        if step == "die":
            pair.group.send([layers[0]], pair.peer, generation).wait()
            os._exit(1)
        send_blocks(pair, tag=generation, layers=layers, timeout_s=TIMEOUT_S)
