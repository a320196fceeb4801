"""Which running requests move their KV to another decode worker, and why (plain Python over
ints; tested without processes):

- **drain**: a decode worker shutting down (SIGTERM: its heartbeat says draining) hands every
  running request to the others instead of making them wait for it or recompute elsewhere;
- **operator**: the same for a worker drained by `pdserve drain` (RouterAdmin.DrainWorker);
- **rebalance**: a decode worker whose KV cache is filled past `threshold` moves the requests
  that will grow most to workers with room, until it is back under `target`, instead of
  preempting one of them by recompute when its blocks run out.

Only a worker with somewhere to move to is asked: with no other decode worker taking work, a
draining worker's requests finish where they are. A worker's load is what its heartbeats say,
so a worker rebalanced is left alone for `cooldown_s` while its reports catch up."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class LiveStream:
    """A decode stream the router is reading now, as a move sees it."""

    request_id: str  # the id the worker knows it by
    worker_id: str
    tokens: int  # prompt + tokens streamed: the KV it holds there, in tokens
    remaining: int  # tokens it may still generate
    movable: bool  # on a decode worker and unconstrained (structured output cannot move)
    cause: str = ""  # set once a move was asked: drain, operator or rebalance
    not_before: float = 0.0  # its worker refused to pause it: not asked again before this


@dataclass(frozen=True)
class DecodeSite:
    """A decode worker as the policy sees it."""

    worker_id: str
    free_blocks: int
    total_blocks: int
    block_size: int
    leaving: str = ""  # why nothing new goes there: "drain" or "operator"; "" takes work

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


@dataclass(frozen=True)
class Move:
    request_id: str
    worker_id: str
    cause: str


@dataclass(frozen=True)
class RebalanceConfig:
    threshold: float = 0.9  # a worker this full (used / total blocks) moves requests; 0: never
    # ... until it is back at this; a target takes requests up to it (0: threshold - 0.1, or
    # half the threshold when that is less)
    target: float = 0.0
    cooldown_s: float = 1.0  # a worker rebalanced waits this long (its heartbeats catch up)

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"--rebalance-threshold must be in [0, 1], got {self.threshold}")
        if not self.target:
            object.__setattr__(self, "target", max(self.threshold - 0.1, self.threshold / 2))
        if self.threshold and not 0.0 < self.target < self.threshold:
            raise ValueError(f"rebalance target must be in (0, threshold={self.threshold}), "
                             f"got {self.target}")
        if self.cooldown_s < 0:
            raise ValueError(f"rebalance cooldown must be >= 0, got {self.cooldown_s}")


class MovePolicy:
    def __init__(self, config: RebalanceConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config or RebalanceConfig()
        self._clock = clock
        self._rebalanced_at: dict[str, float] = {}

    def choose(self, sites: Sequence[DecodeSite], streams: Sequence[LiveStream]) -> list[Move]:
        """The moves to ask for now (`streams`: those that may be asked)."""
        open_sites = [s for s in sites if not s.leaving]
        if not open_sites:
            return []
        by_worker: dict[str, list[LiveStream]] = {}
        for stream in streams:
            by_worker.setdefault(stream.worker_id, []).append(stream)
        moves = [Move(stream.request_id, site.worker_id, site.leaving)
                 for site in sites if site.leaving
                 for stream in by_worker.get(site.worker_id, [])]
        if self.config.threshold:
            moves += self._rebalance(open_sites, by_worker)
        return moves

    def _rebalance(self, sites: list[DecodeSite], by_worker: dict[str, list[LiveStream]]
                   ) -> list[Move]:
        now = self._clock()
        room = {s.worker_id: int(self.config.target * s.total_blocks) - s.used_blocks
                for s in sites}
        moves = []
        for site in sites:
            if site.total_blocks <= 0 or site.used_blocks <= self.config.threshold * \
                    site.total_blocks or now < self._rebalanced_at.get(site.worker_id, -1e18):
                continue
            excess = site.used_blocks - int(self.config.target * site.total_blocks)
            growing = sorted(by_worker.get(site.worker_id, []), key=lambda s: -s.remaining)
            before = len(moves)
            for stream in growing:
                if excess <= 0:
                    break
                blocks = -(-stream.tokens // site.block_size)
                to = max((s for s in sites if s is not site), default=None,
                         key=lambda s: room[s.worker_id])
                if to is None or room[to.worker_id] < blocks:
                    break
                room[to.worker_id] -= blocks
                excess -= blocks
                moves.append(Move(stream.request_id, site.worker_id, "rebalance"))
            if len(moves) > before:
                self._rebalanced_at[site.worker_id] = now + self.config.cooldown_s
        return moves
