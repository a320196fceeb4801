"""A request's dist KV pieces: sent in order on their own thread, a failure ends the stream, and
the shipping thread's wait is bounded (no model, no transport: a recording send)."""

from __future__ import annotations

import threading

import pytest

from kv_transfer.dist.pieces import PieceSender
from kv_transfer.errors import TransferError


def test_pieces_go_in_order_and_drain_waits_for_every_acknowledgement():
    sent: list[tuple[int, int]] = []
    release = threading.Event()

    def send(layers, first_block: int, num_blocks: int) -> None:  # noqa: ANN001
        release.wait(10)
        sent.append((first_block, num_blocks))

    pieces = PieceSender("r1", send)
    pieces.put([], 0, 32)
    pieces.put([], 32, 32)
    with pytest.raises(TransferError, match="still unsent after 0s"):
        pieces.drain(0.05)  # the first piece is still in flight
    release.set()
    pieces.drain(10)
    assert sent == [(0, 32), (32, 32)]
    pieces.close()


def test_a_failed_piece_skips_the_rest_and_drain_raises_it():
    sent: list[int] = []

    def send(layers, first_block: int, num_blocks: int) -> None:  # noqa: ANN001
        if first_block == 32:
            raise TransferError("decode worker refused the piece")
        sent.append(first_block)

    pieces = PieceSender("r1", send)
    for first in (0, 32, 64):
        pieces.put([], first, 32)
    with pytest.raises(TransferError, match="refused the piece"):
        pieces.drain(10)
    assert sent == [0]  # nothing after the failed piece: the decode side freed the blocks
    pieces.close()


def test_cancel_drops_the_pieces_not_yet_sent():
    sent: list[int] = []
    started, release = threading.Event(), threading.Event()

    def send(layers, first_block: int, num_blocks: int) -> None:  # noqa: ANN001
        started.set()
        release.wait(10)
        sent.append(first_block)

    pieces = PieceSender("r1", send)
    pieces.put([], 0, 32)
    pieces.put([], 32, 32)
    assert started.wait(10)
    pieces.close(cancel=True)  # the request was aborted during its first piece
    release.set()
    pieces.drain(10)
    assert sent == [0]
