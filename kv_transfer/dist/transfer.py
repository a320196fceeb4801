"""Send and receive a request's packed KV over a pair group; every wait is bounded."""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch

from kv_transfer.dist.pair import PairGroup
from kv_transfer.errors import TransferError, TransferStats


def _wait_all(works: list, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    for work in works:
        remaining = max(0.001, deadline - time.monotonic())
        try:
            work.wait(datetime.timedelta(seconds=remaining))
        except RuntimeError as exc:
            raise TransferError(f"{what} failed or timed out ({timeout_s:.1f}s): {exc}") from exc


def send_blocks(pair: PairGroup, tag: int, layers: Sequence[torch.Tensor],
                timeout_s: float) -> TransferStats:
    """Send each packed layer to the peer with `tag` (one tag per transfer on this pair)."""
    start = time.perf_counter()
    works = [pair.group.send([layer], pair.peer, tag) for layer in layers]
    _wait_all(works, timeout_s, f"sending KV (tag {tag}) on pair {pair.key}")
    return TransferStats(sum(t.numel() * t.element_size() for t in layers),
                         time.perf_counter() - start)


def receive_blocks(pair: PairGroup, tag: int, shapes: Sequence[torch.Size], dtype: torch.dtype,
                   timeout_s: float) -> tuple[list[torch.Tensor], TransferStats]:
    """Receive packed layers of the given shapes from the peer."""
    start = time.perf_counter()
    buffers = [torch.empty(shape, dtype=dtype, device=pair.device) for shape in shapes]
    works = [pair.group.recv([buf], pair.peer, tag) for buf in buffers]
    _wait_all(works, timeout_s, f"receiving KV (tag {tag}) on pair {pair.key}")
    return buffers, TransferStats(sum(b.numel() * b.element_size() for b in buffers),
                                  time.perf_counter() - start)
