"""The connectors a worker holds, by transport name: the one place that names the transports'
subpackages (workers hold what this builds and never name a transport)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transfer.connector import (
    KVReceiveConnector,
    KVSendConnector,
    OnRefused,
    ReservationBook,
)
from kv_transfer.selection import MODES, TRANSPORTS

if TYPE_CHECKING:
    from engine.kv_memory import KVShards


@dataclass(frozen=True)
class ConnectorOptions:
    worker_id: str
    host: str  # where this worker's transfer endpoints listen
    public_host: str  # how peers reach them
    mode: str  # the worker's --kv-transport: "auto" (every transport) or one of them
    timeout_s: float  # bounds every wait on a peer
    write_pause_s: float = 0.0  # fault injection (tests): a shared writer that stalls

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"kv_transport must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"transfer timeout must be > 0, got {self.timeout_s}")

    @property
    def transports(self) -> tuple[str, ...]:
        return TRANSPORTS if self.mode == "auto" else (self.mode,)


def exports_cache(mode: str) -> bool:
    """Whether a decode worker in `mode` lets same-host peers map its cache (so the cache must be
    allocated shareable)."""
    return mode in ("auto", "shared")


def send_connectors(options: ConnectorOptions, cache: KVShards) -> dict[str, KVSendConnector]:
    # Each transport is imported only when it is used: a worker never loads one it will not run.
    def shared() -> KVSendConnector:
        from kv_transfer.shared.connector import SharedSendConnector

        return SharedSendConnector(options.worker_id, cache, options.timeout_s,
                                   options.write_pause_s)

    def dist() -> KVSendConnector:
        from kv_transfer.dist.connector import DistSendConnector

        return DistSendConnector(options.worker_id, options.host, cache, options.timeout_s)

    build = {"shared": shared, "dist": dist}
    return {name: build[name]() for name in options.transports}


def receive_connectors(options: ConnectorOptions, cache: KVShards, book: ReservationBook,
                       on_refused: OnRefused) -> list[KVReceiveConnector]:
    def shared() -> KVReceiveConnector:
        from kv_transfer.shared.connector import SharedReceiveConnector

        return SharedReceiveConnector(options.worker_id, cache, book)

    def dist() -> KVReceiveConnector:
        from kv_transfer.dist.connector import DistReceiveConnector

        return DistReceiveConnector(options.worker_id, options.host, options.public_host,
                                    cache, options.timeout_s, book, on_refused)

    build = {"shared": shared, "dist": dist}
    return [build[name]() for name in options.transports]
