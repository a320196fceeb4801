"""KV-block transfer between a prefill worker and a decode worker, behind one connector interface
(`connector`) that each transport implements on both sides, end to end, in its own subpackage:

- `shared/`: same host — the decode worker exports its cache once (CPU: a memfd; CUDA: IPC
  handles) and the prefill worker copies a request's blocks straight into the reserved ids;
- `dist/`: across hosts — one pair process group per (sender, receiver) pair through a TCPStore
  rendezvous hosted by the receiver (gloo for CPU tensors, NCCL for CUDA tensors), each piece
  announced by a ReceiveKV control call and checked against its MAC before it is written.

`selection` chooses the transport for a pair from where the workers are (plain Python: the router
imports it); `connectors` builds a worker's connectors; `fake` is an in-process transport for
tests. Importing this package imports neither torch nor grpc.
"""

from __future__ import annotations

from kv_transfer.connector import (
    KVReceiveConnector,
    KVSend,
    KVSendConnector,
    ReservationBook,
    Transfer,
    TransferDescriptor,
    Write,
)
from kv_transfer.errors import TransferError, TransferStats
from kv_transfer.selection import KVPlace, TransportRefused, choose_transport, local_host_id

__all__ = ["KVPlace", "KVReceiveConnector", "KVSend", "KVSendConnector", "ReservationBook",
           "Transfer", "TransferDescriptor", "TransferError", "TransferStats", "TransportRefused",
           "Write", "choose_transport", "local_host_id"]
