"""What a KV transfer reports: its figures, or why it failed."""

from __future__ import annotations

from dataclasses import dataclass


class TransferError(RuntimeError):
    """A transfer failed or timed out; the pair or mapping it used has been torn down.

    `permanent`: the same pair would fail the same way again (the peer's cache cannot be mapped
    from here, the transport is impossible for this placement): do not retry on this pair."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    seconds: float
    transport: str = "dist"
