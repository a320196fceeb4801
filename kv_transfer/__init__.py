"""KV-block transfer between workers over torch.distributed point-to-point.

One pair process group per (sender, receiver) pair, created lazily through a TCPStore rendezvous
hosted by the receiver; gloo for CPU tensors and NCCL for CUDA tensors through the same code.
"""

from __future__ import annotations

from kv_transfer.endpoints import KVReceiver, KVSender, pair_key
from kv_transfer.packing import pack_blocks, packed_shapes, unpack_blocks
from kv_transfer.pair import PairGroup, PairRegistry, TransferError
from kv_transfer.transfer import TransferStats, receive_blocks, send_blocks

__all__ = [
    "KVReceiver", "KVSender", "pair_key",
    "PairGroup", "PairRegistry", "TransferError", "TransferStats", "pack_blocks",
    "packed_shapes", "receive_blocks", "send_blocks", "unpack_blocks",
]
