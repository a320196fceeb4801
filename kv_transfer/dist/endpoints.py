"""The two ends of a request's KV transfer, over pair groups (no gRPC here: the prefill worker
starts the decode worker's receive with a control RPC, then calls `KVSender.send`).

Protocol for one transfer on pair `key` = "{sender}->{receiver}":
1. the sender names the pair's generation and a fresh tag in its control message;
2. the receiver checks the request, then writes `ready/{key}/{generation}/{tag}` = "ok" or an
   error into its own rendezvous store;
3. the sender waits for that key (bounded) and, on "ok", rendezvouses (new pairs only) and sends
   each packed layer; the receiver receives, checks the bytes against the MAC the control
   message carried (`integrity`), and only then writes the blocks into its cache.
Any failure but a refusal tears the pair down on that side; both sides rebuild it under the next
generation.
"""

from __future__ import annotations

import datetime
import itertools
import secrets
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from engine.kv_memory import KVShards
from kv_transfer.dist.packing import pack_blocks, packed_shapes, unpack_blocks
from kv_transfer.dist.pair import (
    RECEIVER_RANK,
    SENDER_RANK,
    PairRegistry,
    connect_store,
    host_store,
)
from kv_transfer.dist.transfer import receive_blocks, send_blocks
from kv_transfer.errors import TransferError, TransferStats

# What NCCL and gloo say when the pair itself is impossible (e.g. two ranks on one GPU): trying
# the same pair again fails the same way.
PERMANENT_ERRORS = ("invalid usage", "duplicate gpu", "unsupported device")


def will_repeat(exc: BaseException) -> bool:
    message = str(exc).lower()
    return any(marker in message for marker in PERMANENT_ERRORS)


class TransferRefused(TransferError):
    """The receiver answered and refused (no such reservation: aborted, expired): nothing was
    sent and both sides are still in step, so the pair is kept. Tearing it down made the next
    transfer rendezvous anew, a gloo or NCCL group set up per cancelled request."""


def pair_key(sender_id: str, receiver_id: str) -> str:
    return f"{sender_id}->{receiver_id}"


def _ready_key(key: str, generation: int, tag: int) -> str:
    return f"ready/{key}/{generation}/{tag}"


class KVReceiver:
    """Decode side: hosts the rendezvous store and receives into its KV cache."""

    def __init__(self, worker_id: str, host: str, device: torch.device, timeout_s: float):
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.store = host_store(host, 0, timeout_s)
        self.registry = PairRegistry(RECEIVER_RANK, device, host, timeout_s)

    @property
    def port(self) -> int:
        return self.store.port

    def refuse(self, sender_id: str, generation: int, tag: int, reason: str) -> None:
        """Tell a waiting sender not to send (the request is unknown or its blocks are gone)."""
        key = pair_key(sender_id, self.worker_id)
        self.store.set(_ready_key(key, generation, tag), f"error: {reason}"[:500])

    def receive(self, sender_id: str, generation: int, tag: int,
                kv_caches: KVShards, block_ids: Sequence[int],
                check: Callable[[Sequence[torch.Tensor]], None]) -> TransferStats:
        """Receive one request's blocks into `block_ids` of `kv_caches` (bounded waits).

        `check` sees the received bytes before anything is written (`integrity.verify_piece`)
        and refuses them by raising: the cache is then untouched. The pair stays: the receive
        completed, so it is in step with its peer."""
        key = pair_key(sender_id, self.worker_id)
        self.store.set(_ready_key(key, generation, tag), "ok")
        try:
            pair = self.registry.get(self.store, key, generation)
            layers, stats = receive_blocks(pair, tag, packed_shapes(kv_caches, len(block_ids)),
                                           kv_caches.primary.dtype, self.timeout_s)
        except (TransferError, RuntimeError) as exc:
            self.registry.tear_down(key)
            raise TransferError(f"receiving KV from {sender_id}: {exc}") from exc
        check(layers)
        unpack_blocks(kv_caches, block_ids, layers)
        return stats


class KVSender:
    """Prefill side: one pair per decode worker, one transfer at a time per pair."""

    def __init__(self, worker_id: str, host: str, device: torch.device, timeout_s: float):
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        # A sender restarted under the same id must not reuse a generation (and with it the
        # store keys) of its previous life: each process starts at a random generation.
        self.registry = PairRegistry(SENDER_RANK, device, host, timeout_s,
                                     first_generation=secrets.randbelow(2**31))
        self._stores: dict[str, dist.TCPStore] = {}
        self._receiver_stores: dict[str, str] = {}  # receiver id -> its store's address
        self._locks: dict[str, threading.Lock] = {}
        self._tags = itertools.count(1)
        self._lock = threading.Lock()

    def send(self, receiver_id: str, store_address: str, kv_caches: KVShards,
             block_ids: Sequence[int], start_receive: Callable[[int, int], object]
             ) -> TransferStats:
        """Send the blocks; `start_receive(generation, tag)` must make the receiver call
        `KVReceiver.receive` (it is called before anything is sent)."""
        return self.send_packed(receiver_id, store_address, pack_blocks(kv_caches, block_ids),
                                start_receive)

    def send_packed(self, receiver_id: str, store_address: str, layers: Sequence[torch.Tensor],
                    start_receive: Callable[[int, int], object]) -> TransferStats:
        """Send blocks packed already (`pack_blocks`: a piece of a prompt packed between two
        steps, while its source blocks could not change)."""
        key = pair_key(self.worker_id, receiver_id)
        with self._pair_lock(key):
            self._forget_if_moved(key, receiver_id, store_address)
            generation = self.registry.current_generation(key)
            tag = next(self._tags)
            try:
                store = self._store(store_address)
                start_receive(generation, tag)
                self._await_ready(store, key, generation, tag)
                pair = self.registry.get(store, key, generation)
                return send_blocks(pair, tag, layers, self.timeout_s)
            except TransferRefused as exc:  # the pair is sound and in step: it stays
                raise TransferError(f"sending KV to {receiver_id}: {exc}") from exc
            except (TransferError, RuntimeError) as exc:
                self.registry.tear_down(key)
                with self._lock:
                    self._stores.pop(store_address, None)
                # Only the backend's own errors say the pair is impossible (a refusal's text
                # quotes request ids, which clients choose).
                permanent = not isinstance(exc, TransferError) and will_repeat(exc)
                raise TransferError(f"sending KV to {receiver_id}: {exc}",
                                    permanent=permanent) from exc

    def _forget_if_moved(self, key: str, receiver_id: str, store_address: str) -> None:
        """A receiver that comes back under the same id (a restarted actor) hosts its store at a
        new address: the pair with its previous process is dead, so drop it before sending."""
        with self._lock:
            previous = self._receiver_stores.get(receiver_id)
            self._receiver_stores[receiver_id] = store_address
            if previous is None or previous == store_address:
                return
            self._stores.pop(previous, None)
        self.registry.tear_down(key)

    def _await_ready(self, store: dist.TCPStore, key: str, generation: int, tag: int) -> None:
        ready = _ready_key(key, generation, tag)
        store.wait([ready], datetime.timedelta(seconds=self.timeout_s))
        answer = store.get(ready).decode()
        store.delete_key(ready)
        if answer != "ok":
            raise TransferRefused(f"receiver refused the transfer: {answer}")

    def _store(self, address: str) -> dist.TCPStore:
        with self._lock:
            if address not in self._stores:
                self._stores[address] = connect_store(address, self.timeout_s)
            return self._stores[address]

    def _pair_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(key, threading.Lock())
