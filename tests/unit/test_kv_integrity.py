"""The dist transport's piece MAC (kv_transfer.dist.integrity): it changes with every byte of the
piece and with everything that names the piece — request, block range, last-piece flag, dtype,
layer shapes — and with the transfer secret; verification accepts only the exact tag."""

from __future__ import annotations

import hmac

import pytest
import torch

from kv_transfer.dist.integrity import IntegrityError, PieceId, piece_key, piece_mac, verify_piece

SECRET = "the-routers-secret"
PIECE = PieceId("req-1", first_block=4, num_blocks=3, last=False)


def layers(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, 3, 4, 2, 8), generator=g) for _ in range(3)]


def test_the_tag_is_a_deterministic_hmac_sha256_under_a_key_derived_from_the_secret():
    tag = piece_mac(SECRET, PIECE, layers())
    assert len(tag) == 32 and tag == piece_mac(SECRET, PIECE, layers())
    assert piece_key(SECRET) != SECRET.encode() and len(piece_key(SECRET)) == 32
    verify_piece(SECRET, PIECE, layers(), tag)  # the exact piece passes


@pytest.mark.parametrize("layer,index", [(0, 0), (1, 77), (2, -1)])
def test_any_changed_byte_changes_the_tag(layer, index):
    tag = piece_mac(SECRET, PIECE, layers())
    forged = layers()
    raw = forged[layer].view(-1).view(torch.uint8)
    raw[index] ^= 0x01  # one bit of one byte
    assert piece_mac(SECRET, PIECE, forged) != tag
    with pytest.raises(IntegrityError, match="does not match its MAC"):
        verify_piece(SECRET, PIECE, forged, tag)


@pytest.mark.parametrize("other", [
    PieceId("req-2", 4, 3, False),  # another request
    PieceId("req-1", 0, 3, False),  # another place in the stream (an earlier piece)
    PieceId("req-1", 7, 3, False),  # a later one
    PieceId("req-1", 4, 2, False),  # another block count
    PieceId("req-1", 4, 3, True),  # claimed as the last piece
])
def test_the_tag_names_the_piece_so_it_cannot_be_replayed_or_reordered(other):
    tag = piece_mac(SECRET, PIECE, layers())
    assert piece_mac(SECRET, other, layers()) != tag
    with pytest.raises(IntegrityError):
        verify_piece(SECRET, other, layers(), tag)


def test_the_tag_depends_on_the_secret_dtype_and_shapes():
    tag = piece_mac(SECRET, PIECE, layers())
    assert piece_mac("another-secret", PIECE, layers()) != tag
    assert piece_mac("", PIECE, layers()) != tag
    same_bytes_as_int = [t.view(torch.int32) for t in layers()]
    assert piece_mac(SECRET, PIECE, same_bytes_as_int) != tag
    split = [t.reshape(2, 3, 4, 16) for t in layers()]  # same bytes, other layer shapes
    assert piece_mac(SECRET, PIECE, split) != tag
    merged = [torch.cat([t.reshape(-1) for t in layers()])]  # same bytes, one layer
    assert piece_mac(SECRET, PIECE, merged) != tag


def test_half_precision_layers_are_hashed_by_their_bytes():
    halves = [t.to(torch.bfloat16) for t in layers()]
    tag = piece_mac(SECRET, PIECE, halves)
    halves[1].view(-1).view(torch.int16)[5] ^= 1
    assert not hmac.compare_digest(piece_mac(SECRET, PIECE, halves), tag)


@pytest.mark.parametrize("tag", [b"", b"\0" * 32])
def test_a_missing_or_blank_tag_is_refused(tag):
    with pytest.raises(IntegrityError):
        verify_piece(SECRET, PIECE, layers(), tag)
