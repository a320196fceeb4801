"""KV-block transfer between a prefill worker and a decode worker, by one of two transports chosen
per pair from where the workers are (`selection`):

- shared (`shared`): same host — the decode worker exports its cache once (CPU: a memfd; CUDA:
  IPC handles) and the prefill worker copies a request's blocks straight into the reserved ids;
- dist (`endpoints`, `pair`, `transfer`): across hosts — one pair process group per (sender,
  receiver) pair through a TCPStore rendezvous hosted by the receiver; gloo for CPU tensors and
  NCCL for CUDA tensors through the same code; each piece's bytes are checked against a MAC
  keyed by the transfer secret before they are written (`integrity`).

`selection` is plain Python (the router imports it); everything else loads torch lazily on first
use, so importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from kv_transfer.selection import KVPlace, TransportRefused, choose_transport, local_host_id

_LAZY = {
    "KVReceiver": "endpoints", "KVSender": "endpoints", "pair_key": "endpoints",
    "PairGroup": "pair", "PairRegistry": "pair", "TransferError": "errors",
    "TransferStats": "errors", "pack_blocks": "packing", "packed_shapes": "packing",
    "unpack_blocks": "packing", "receive_blocks": "transfer", "send_blocks": "transfer",
    "KVExporter": "shared", "SharedSender": "shared_sender", "SharedWrite": "shared_sender",
    "device_identity": "shared", "IntegrityError": "integrity", "PieceId": "integrity",
    "piece_mac": "integrity", "verify_piece": "integrity",
}

__all__ = ["KVPlace", "TransportRefused", "choose_transport", "local_host_id", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kv_transfer.{module}"), name)
