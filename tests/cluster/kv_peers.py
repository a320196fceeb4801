"""Process bodies for the KV-transfer tests (importable by spawned children)."""

from __future__ import annotations

import torch

from engine.kv_memory import KVBuffer, KVShards
from kv_transfer.dist.endpoints import KVReceiver, KVSender
from kv_transfer.dist.integrity import IntegrityError, PieceId, piece_mac, verify_piece
from kv_transfer.dist.packing import pack_blocks, packed_shapes, unpack_blocks
from kv_transfer.dist.pair import (
    RECEIVER_RANK,
    SENDER_RANK,
    PairRegistry,
    connect_store,
    host_store,
)
from kv_transfer.errors import TransferError

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 16, 4, 2, 8
SRC_BLOCKS, DST_BLOCKS = [3, 7, 1, 12], [10, 2, 5, 0]
TIMEOUT_S = 2.0


def make_caches(seed: int | None) -> KVShards:
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if seed is None:
        tensor = torch.zeros(shape)
    else:
        tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return KVShards.whole(KVBuffer(tensor, list(tensor.unbind(0))))


def expected_checksum() -> float:
    caches = make_caches(seed=1)
    return float(sum(layer.double().sum() for layer in pack_blocks(caches, SRC_BLOCKS)))


def receiver(queue, plan: list[str]) -> None:
    """For each step of `plan`: 'recv' a transfer, or 'timeout' (expect none to arrive)."""
    from kv_transfer.dist.transfer import receive_blocks

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

    from kv_transfer.dist.transfer import send_blocks

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


# ---- MAC-checked transfers: the real KVReceiver / KVSender, the control call as a queue -------
SECRET = "the-routers-secret"


def piece() -> PieceId:
    return PieceId("req-1", first_block=0, num_blocks=len(DST_BLOCKS), last=True)


def checked_receiver(queue, control, steps: int) -> None:
    """Receive `steps` transfers with `KVReceiver.receive`, each checked against the MAC its
    control message (from `control`) announced; report what landed in the whole cache."""
    receiver = KVReceiver("d", "127.0.0.1", torch.device("cpu"), TIMEOUT_S)
    queue.put(("port", receiver.port))
    caches = make_caches(seed=None)
    for _ in range(steps):
        generation, tag, mac = control.get(timeout=60)
        try:
            receiver.receive("p", generation, tag, caches, DST_BLOCKS,
                             lambda layers, mac=mac: verify_piece(SECRET, piece(), layers, mac))
            outcome = "ok"
        except IntegrityError:
            outcome = "refused"
        whole = float(caches.primary.double().abs().sum())
        landed = float(sum(t.double().sum() for t in pack_blocks(caches, DST_BLOCKS)))
        queue.put((outcome, whole, landed))


def checked_sender(port: int, control, plan: list[str]) -> None:
    """For each step: 'honest' (the MAC of the bytes sent), 'forged' (the MAC of the real
    bytes, other bytes sent) or 'wrong-key' (the real bytes, a MAC under a guessed secret)."""
    sender = KVSender("p", "127.0.0.1", torch.device("cpu"), TIMEOUT_S)
    real = pack_blocks(make_caches(seed=1), SRC_BLOCKS)
    for step in plan:
        sent = [torch.full_like(t, 0.5) for t in real] if step == "forged" else real
        mac = piece_mac("a-guess" if step == "wrong-key" else SECRET, piece(), real)
        sender.send_packed("d", f"127.0.0.1:{port}", sent,
                           lambda generation, tag, mac=mac: control.put((generation, tag, mac)))
