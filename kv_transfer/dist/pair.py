"""Pair process groups: two ranks (0 = receiver, which hosts the store; 1 = sender)."""

from __future__ import annotations

import datetime
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kv_transfer.errors import TransferError

RECEIVER_RANK = 0
SENDER_RANK = 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def host_store(host: str, port: int = 0, timeout_s: float = 30.0) -> dist.TCPStore:
    """The receiver's rendezvous store (port 0 picks a free port: read `store.port`)."""
    return dist.TCPStore(host, port, is_master=True, timeout=_timedelta(timeout_s),
                         wait_for_workers=False)


def connect_store(address: str, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client of the receiver's store. A dead receiver fails at once (TransferError): the
    TCPStore client alone would retry connecting for the whole timeout."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=min(timeout_s, 5.0)).close()
    except OSError as exc:
        raise TransferError(f"the KV store at {address} is unreachable: {exc}") from exc
    return dist.TCPStore(host, int(port), is_master=False, timeout=_timedelta(timeout_s),
                         wait_for_workers=False)


@dataclass
class PairGroup:
    """A two-rank process group for one (sender, receiver) pair and one generation of it."""

    key: str
    generation: int
    rank: int
    group: dist.ProcessGroup
    device: torch.device

    @property
    def peer(self) -> int:
        return SENDER_RANK if self.rank == RECEIVER_RANK else RECEIVER_RANK

    @classmethod
    def create(cls, store: dist.Store, key: str, generation: int, rank: int,
               device: torch.device, host: str, timeout_s: float) -> PairGroup:
        """Rendezvous with the peer (which must call this too, with the other rank).

        `timeout_s` bounds the rendezvous and is the group's default; each transfer passes its
        own, shorter bound to `Work.wait`."""
        prefix = dist.PrefixStore(f"pair/{key}/{generation}", store)
        timeout = _timedelta(timeout_s)
        if backend_for(device) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefix, rank, 2, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            group = dist.ProcessGroupGloo(prefix, rank, 2, options)
        return cls(key, generation, rank, group, device)


class PairRegistry:
    """This worker's pair groups, by pair key. A broken pair is torn down; its replacement is
    created on next use with the next generation number (the sender names the generation in its
    control message, so both sides rendezvous under the same store prefix)."""

    def __init__(self, rank: int, device: torch.device, host: str,
                 rendezvous_timeout_s: float = 30.0, first_generation: int = 0):
        self.rank = rank
        self.first_generation = first_generation
        self.device = device
        self.host = host
        self.timeout_s = rendezvous_timeout_s
        self._pairs: dict[str, PairGroup] = {}
        self._next_generation: dict[str, int] = {}
        self._lock = threading.Lock()
        self._setups: dict[str, threading.Lock] = {}  # one setup at a time per pair

    def get(self, store: dist.Store, key: str, generation: int) -> PairGroup:
        """The pair `key` at `generation`, set up (a rendezvous with the peer, bounded by the
        timeout) when it is not yet. One pair's setup holds up only that pair: a receiver that
        held one lock through every setup let a dead sender's stall every other sender's
        transfers for the whole timeout."""
        found = self._live(key, generation)
        if found is not None:
            return found
        with self._lock:
            setup = self._setups.setdefault(key, threading.Lock())
        with setup:
            found = self._live(key, generation)  # set up meanwhile by another transfer
            if found is not None:
                return found
            pair = PairGroup.create(store, key, generation, self.rank, self.device, self.host,
                                    self.timeout_s)
            with self._lock:
                self._pairs[key] = pair
                self._next_generation[key] = generation + 1
            return pair

    def _live(self, key: str, generation: int) -> PairGroup | None:
        with self._lock:
            pair = self._pairs.get(key)
            return pair if pair is not None and pair.generation == generation else None

    def current_generation(self, key: str) -> int:
        """The generation a sender should name for `key`: the live pair's, else a fresh one."""
        with self._lock:
            pair = self._pairs.get(key)
            if pair is not None:
                return pair.generation
            return self._next_generation.get(key, self.first_generation)

    def tear_down(self, key: str) -> None:
        """Forget a broken pair; the next `get` rendezvouses anew under the next generation."""
        with self._lock:
            self._pairs.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._pairs
