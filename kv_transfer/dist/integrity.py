"""Authenticating the dist transport's bytes: a MAC of each KV piece, keyed by the transfer secret.

The gloo/NCCL connections of a pair group carry raw tensors from whoever is on the other end; the
ReceiveKV control call that announces a piece is authenticated (cluster token, mTLS) and carries
the reservation's transfer secret. The sender computes an HMAC-SHA256 of the piece's packed bytes
under a key derived from that secret and puts the tag in the control call; the receiver computes
it again over the bytes it received and writes them into its cache only if the two agree.

The MAC input names the piece, so a piece cannot be replayed into another request, moved to
other blocks or reordered: the request id, the piece's block range (`first_block`, the piece's
place in the stream — pieces are contiguous and in order, so it indexes them — and
`num_blocks`), whether it is the last piece, the dtype and every layer's shape, then each layer's
bytes. Every field is length-prefixed, so no two inputs encode alike. Plain hashlib/hmac: the
comparison is constant-time (`hmac.compare_digest`).

This authenticates, it does not encrypt: the KV bytes still cross the network in the clear.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_transfer.errors import TransferError

KEY_LABEL = b"pdserve/dist-kv-piece/v1"  # binds the derived key to this one use of the secret


class IntegrityError(TransferError):
    """The bytes received do not match the MAC the authenticated control call announced: they
    came from someone else, or were altered. Nothing of them has been written."""


@dataclass(frozen=True)
class PieceId:
    """What a piece's MAC binds besides its bytes."""

    request_id: str
    first_block: int
    num_blocks: int
    last: bool  # the transfer's last piece (ReceiveKVRequest.more is False)


def piece_key(secret: str) -> bytes:
    """The MAC key of a transfer: derived from its secret (never the secret itself)."""
    return hmac.new(secret.encode(), KEY_LABEL, hashlib.sha256).digest()


def _field(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


def _header(piece: PieceId, layers: Sequence[torch.Tensor]) -> bytes:
    dtype = str(layers[0].dtype).removeprefix("torch.") if layers else ""
    parts = [piece.request_id.encode(), struct.pack(">QQ?", piece.first_block,
                                                    piece.num_blocks, piece.last),
             dtype.encode(), struct.pack(">Q", len(layers))]
    parts += [struct.pack(f">{layer.dim()}Q", *layer.shape) for layer in layers]
    return b"".join(_field(p) for p in parts)


def _host_bytes(layer: torch.Tensor) -> memoryview:
    """The layer's bytes as the host sees them, without a copy on CPU.

    CUDA tensors are copied to host memory first (`.cpu()` waits for the copy): the simplest
    correct thing, and unmeasured on a GPU — hashing there costs a device-to-host copy of every
    piece on each side."""
    flat = layer.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.numpy())


def piece_mac(secret: str, piece: PieceId, layers: Sequence[torch.Tensor]) -> bytes:
    """HMAC-SHA256 of the piece (see the module doc) under the transfer's key."""
    mac = hmac.new(piece_key(secret), _header(piece, layers), hashlib.sha256)
    for layer in layers:
        mac.update(_host_bytes(layer))
    return mac.digest()


def verify_piece(secret: str, piece: PieceId, layers: Sequence[torch.Tensor],
                 tag: bytes) -> None:
    """IntegrityError unless `tag` is the piece's MAC (compared in constant time)."""
    if not hmac.compare_digest(piece_mac(secret, piece, layers), tag):
        raise IntegrityError(f"KV piece of request {piece.request_id!r} (blocks "
                             f"{piece.first_block}..{piece.first_block + piece.num_blocks}) "
                             f"does not match its MAC: refused, nothing written")
