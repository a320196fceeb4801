"""What a prefill hands over: the decode side it ships to, what the router gets back, and the
decode workers' control RPCs the shipping uses (prefill_worker.service implements them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.request import Request
from kv_transfer import KVPlace, TransferStats
from prefill_worker.streaming import KVStream


@dataclass(frozen=True)
class DecodeTarget:
    worker_id: str
    address: str  # gRPC
    transfer_address: str  # KV rendezvous store (dist transport)
    block_ids: list[int]
    place: KVPlace | None = None  # where its cache lives (None: an unknown place, dist only)
    export_address: str = ""  # its cache's export (shared transport)
    # The prompt's first blocks the decode worker holds already (its prefix cache): not sent;
    # `block_ids` receive our blocks after them.
    num_cached_blocks: int = 0
    transfer_secret: str = ""  # the reservation's: the decode worker admits no write without it


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    logprobs: dict[int, float] | None
    finish_reason: str | None  # set when the first token ends the request (nothing shipped)
    stop_reason: int | str | None
    cached_tokens: int
    queue_s: float  # arrival here -> the prompt's first step
    prefill_s: float  # the prompt's first step -> its first token
    transfer: TransferStats | None


class DecodeControl(Protocol):
    """The decode workers' KV control RPCs (prefill_worker.service.DecodeStubs)."""

    def start_receive(self, target: DecodeTarget, request_id: str, generation: int, tag: int,
                      num_blocks: int, dtype: str, first_block: int = 0,
                      more: bool = False, mac: bytes = b"") -> Callable[[float], object]:
        """ReceiveKV (dist transport) of the blocks, or of the piece of them from `first_block`
        (`more`: pieces follow), whose bytes have the MAC `mac` (kv_transfer.integrity):
        returns a wait for the decode side's acknowledgement (TransferError if refused)."""


@dataclass
class ShipPlan:
    """How one request's KV goes out."""

    request: Request
    target: DecodeTarget
    blocks: list[int]  # our block ids, in the order of target.block_ids
    dtype: str
    stream: KVStream | None = None  # its write, opened (and partly copied) during the prefill
