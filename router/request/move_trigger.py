"""Asks decode workers to pause the running requests the move policy picked (router.policy.moves):
each one's stream then ends with `paused`, and the request's own orchestrator thread moves it
(router.request.moving). Runs on its own thread, every `interval_s`; every call is bounded."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import grpc

from pdserve_proto import pdserve_pb2 as pb
from router.fleet.registry import Role, WorkerRegistry
from router.policy.moves import DecodeSite, Move, MovePolicy
from router.request.live_streams import LiveStreams
from router.request.worker_client import WorkerStubs

log = logging.getLogger(__name__)
PAUSE_TIMEOUT_S = 35.0  # beyond the worker's own bound on a loop command (30 s)


class MoveTrigger:
    def __init__(self, registry: WorkerRegistry, streams: LiveStreams, policy: MovePolicy,
                 stubs: WorkerStubs, park_lease_s: float, interval_s: float = 0.2):
        self.registry = registry
        self.streams = streams
        self.policy = policy
        self.stubs = stubs
        self.park_lease_s = park_lease_s  # a parked request the router never moves is freed
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="move-trigger", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # a bad tick must not end the thread: the next one tries again
                log.exception("move trigger failed")

    def tick(self) -> list[Move]:
        """Ask for the moves the policy picks now; the moves whose pause was accepted."""
        sites = [DecodeSite(w.worker_id, w.load.free_blocks, w.load.total_blocks,
                            w.block_size, w.leaving)
                 for w in self.registry.snapshot()
                 if w.role is Role.DECODE and self.registry.live(w)]
        by_worker: dict[str, list[Move]] = defaultdict(list)
        for move in self.policy.choose(sites, self.streams.snapshot()):
            if self.streams.ask(move.request_id, move.cause):
                by_worker[move.worker_id].append(move)
        return [move for worker_id, moves in by_worker.items()
                for move in self._pause(worker_id, moves)]

    def _pause(self, worker_id: str, moves: list[Move]) -> list[Move]:
        worker = self.registry.get(worker_id)
        ids = [m.request_id for m in moves]
        paused: set[str] = set()
        if worker is not None:
            try:
                reply = self.stubs.decode(worker).Pause(
                    pb.PauseRequest(request_ids=ids, lease_s=self.park_lease_s),
                    timeout=PAUSE_TIMEOUT_S)
                paused = set(reply.paused)
            except grpc.RpcError as exc:
                log.warning("pausing %d requests on %s failed: %s", len(ids), worker_id,
                            exc.code().name)
        for rid in ids:
            if rid not in paused:
                self.streams.refused(rid)
        if paused:
            log.info("%s: %d running requests pause to move (%s)", worker_id, len(paused),
                     ", ".join(sorted({m.cause for m in moves})))
        return [m for m in moves if m.request_id in paused]
