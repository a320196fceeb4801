"""The KV connector: the one interface between the workers and a transport (ARCHITECTURE.md, "The
KV transfer contract").

A transport implements both sides, each owning its control path end to end:

- the **sender side** (prefill worker): `KVSendConnector.begin` opens one request's transfer into
  the reservation a `TransferDescriptor` names; the `KVSend` it returns sends the blocks each
  prefill chunk finished (`send_ready`, between engine steps), then the rest (`finish`, which
  returns once the receiver has acknowledged), or ends it (`abort`);
- the **receiver side** (decode worker): a `KVReceiveConnector` exports the cache and accepts
  writers (`endpoint`: what a descriptor tells senders; `services`: the gRPC services it adds to
  the worker's server), and admits each write into reserved blocks, completes it or refuses it
  through the `ReservationBook` the worker gives it.

Workers hold connectors by transport name and never name one; `kv_transfer.connectors` builds
them. The transport is chosen once, where the router places the (prefill, decode) pair
(`kv_transfer.selection`), and travels with the request (`Transfer.transport`).

Plain Python: importing this module imports neither torch nor grpc.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kv_transfer.errors import TransferStats


@dataclass(frozen=True)
class TransferDescriptor:
    """Where one reservation's KV goes: the decode worker's reply to Reserve, which the router
    passes to the prefill worker without reading it (`KVTransferDescriptor` on the wire)."""

    receiver_id: str
    block_ids: tuple[int, ...]  # the reserved blocks the KV goes into, in prompt order
    num_cached_blocks: int = 0  # the prompt's first blocks the receiver holds already: not sent
    # transport name -> that transport's addresses on the receiver, by role
    endpoints: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def to_proto(self) -> Any:
        from pdserve_proto import pdserve_pb2 as pb

        message = pb.KVTransferDescriptor(receiver_id=self.receiver_id,
                                          block_ids=list(self.block_ids),
                                          num_cached_blocks=self.num_cached_blocks)
        for transport, addresses in self.endpoints.items():
            message.endpoints[transport].addresses.update(addresses)
        return message

    @classmethod
    def from_proto(cls, message: Any) -> TransferDescriptor:
        return cls(message.receiver_id, tuple(message.block_ids), message.num_cached_blocks,
                   {name: dict(e.addresses) for name, e in message.endpoints.items()})

    def endpoint(self, transport: str) -> Mapping[str, str]:
        """The receiver's addresses for `transport` (ValueError: it offers none)."""
        addresses = self.endpoints.get(transport)
        if addresses is None:
            offered = ", ".join(sorted(self.endpoints)) or "none"
            raise ValueError(f"transfer.endpoints: decode worker {self.receiver_id} offers no "
                             f"{transport!r} endpoint (it offers {offered})")
        return addresses


@dataclass(frozen=True)
class Transfer:
    """One request's KV transfer as the prefill worker is told it."""

    request_id: str
    transport: str  # chosen by the router when it placed the pair
    descriptor: TransferDescriptor
    secret: str  # the reservation's transfer secret: the receiver admits no write without it
    dtype: str  # the sender's KV dtype ("bfloat16", ...): the receiver's must match

    @property
    def num_blocks(self) -> int:
        return len(self.descriptor.block_ids)


class KVSend(ABC):
    """The sender's side of one request's transfer. Blocks are named by the sender's own block
    ids, in the order of the descriptor's `block_ids`."""

    @abstractmethod
    def send_ready(self, src_block_ids: Sequence[int]) -> int:
        """The transfer's first `len(src_block_ids)` blocks are computed: send those not sent yet,
        without waiting on the receiver (the engine loop calls this between steps, while the
        blocks cannot change). Returns the bytes handed over now (0: try again next step)."""

    @abstractmethod
    def finish(self, src_block_ids: Sequence[int]) -> TransferStats:
        """Send every block not sent yet (`src_block_ids` is the whole transfer) and end the
        transfer; returns once the receiver has acknowledged (TransferError otherwise: the
        transfer is then ended as failed and the receiver frees its blocks)."""

    @abstractmethod
    def abort(self) -> None:
        """End the transfer as failed without waiting (the receiver frees the blocks)."""


class KVSendConnector(ABC):
    """A transport's sender side in one prefill worker, over its whole KV cache."""

    transport: str

    @abstractmethod
    def begin(self, transfer: Transfer) -> KVSend:
        """Open `transfer` without waiting on the receiver (a refusal or a broken peer surfaces
        at `finish`). ValueError when the descriptor lacks what this transport needs."""

    @abstractmethod
    def close(self) -> None:
        """Let go of every peer (no transfer of ours is in flight by then)."""


@dataclass(frozen=True)
class Write:
    """One write into a reservation, as a receiver connector asks its worker to admit it: the
    whole transfer, or one piece of it (`first_block`, `last`)."""

    transport: str
    writer: str  # who writes: a name the transport gives the sender's connection
    request_id: str
    num_blocks: int
    dtype: str
    secret: str
    first_block: int = 0  # into the reservation's fresh blocks (after its cached ones)
    last: bool = True  # the transfer's last piece: the reservation is READY after it


class ReservationBook(Protocol):
    """What a decode worker gives its receiver connectors: its reservations (the invariant is
    decode_worker.reservations': no block is freed while a write into it may still land)."""

    def admit(self, write: Write) -> list[int]:
        """Admit `write` and return the block ids it writes (KeyError: no such reservation;
        PermissionError: wrong secret; ValueError: it does not fit). The reservation is
        RECEIVING until `complete`, `refuse` or `writer_gone`."""

    def complete(self, write: Write, ok: bool, stats: TransferStats | None) -> bool:
        """The write ended, well or not; whether the request still holds its blocks."""

    def refuse(self, write: Write, reason: str) -> bool:
        """The write's bytes were refused before anything was written (they failed their
        check): RESERVED again. Whether the request still holds its blocks."""

    def writer_gone(self, writer: str) -> None:
        """No write by `writer` can land any more (its connection closed)."""


# (method, status code name, message): how a receiver's gRPC service reports a refusal to its
# worker (which counts and logs it) before aborting the call.
OnRefused = Callable[[str, str, str], None]


@dataclass(frozen=True)
class GrpcService:
    """A gRPC service a receiver connector adds to its worker's server."""

    names: tuple[str, ...]  # full service names (internal: the cluster token is required)
    add_to_server: Callable[[Any], None]


class KVReceiveConnector(ABC):
    """A transport's receiver side in one decode worker, over its whole KV cache."""

    transport: str

    @abstractmethod
    def endpoint(self) -> Mapping[str, str]:
        """How this transport's senders reach us (goes into every TransferDescriptor)."""

    def services(self) -> list[GrpcService]:
        """gRPC services this transport's control path needs on the worker's server."""
        return []

    def bind(self, address: str) -> None:  # noqa: B027 - optional
        """The worker's gRPC server listens at `address` (host:port) from now on."""

    @abstractmethod
    def close(self) -> None:
        """Stop accepting writers."""


def receiver_identity(connectors: Sequence[KVReceiveConnector]) -> str:
    """A name for this process's receivers, new in every process (it joins their endpoints)."""
    return " ".join(f"{c.transport}:{','.join(sorted(c.endpoint().values()))}"
                    for c in connectors)
