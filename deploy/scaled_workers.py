"""The workers the autoscaler added, on Ray: started without waiting (a placement group of their
own, so Ray or a Ray autoscaler finds the resources), seen registered, given up when they never
register, drained through the router and stopped. After the autoscaler's own restart they are
found again by name (actors named like workers that the deployment did not start)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

from common.client import cluster_status
from common.grpc_server import internal_channel
from deploy.config import DeployConfig
from deploy.signals import ROLE_NAMES
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 10.0


def worker_pattern(name: str) -> re.Pattern[str]:
    """Actor names of a deployment's workers: `{name}-prefill-3`, `{name}-decode-0`."""
    return re.compile(rf"^{re.escape(name)}-(prefill|decode)-(\d+)$")


class ScaledWorkers:
    def __init__(self, config: DeployConfig, router: dict[str, Any], root_ca: bytes | None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.router = router  # the router actor's info(): addresses
        self.root_ca = root_ca
        self._clock = clock
        self.added: list[tuple[str, str]] = []  # (role, worker id), oldest first
        self._starting: dict[str, float] = {}  # added, not registered yet -> since when
        self._recover()

    def _recover(self) -> None:
        if not ray.is_initialized():  # outside Ray (tests of the policy loop): nothing to find
            return
        first = {worker_id for _, worker_id in self.config.worker_names}
        pattern = worker_pattern(self.config.name)
        found = [m for n in ray.util.list_named_actors() if (m := pattern.match(n))]
        for match in sorted(found, key=lambda m: (m[1], int(m[2]))):
            worker_id = f"{match[1]}-{match[2]}"
            if worker_id not in first:
                self.added.append((match[1], worker_id))
                self._starting[worker_id] = self._clock()  # until seen registered

    def starting(self) -> dict[str, int]:
        """Role -> workers added and not registered yet (on their way: they count)."""
        counts: dict[str, int] = {}
        for role, worker_id in self.added:
            if worker_id in self._starting:
                counts[role] = counts.get(role, 0) + 1
        return counts

    def settle(self, registered: frozenset[str]) -> list[str]:
        """Note which added workers registered; forget those gone since (dead: Ray may bring
        one back, as a worker like any other); give up those that never registered within
        placement.timeout_s (stopped, their placement groups removed). Returns those."""
        given_up = []
        for role, worker_id in list(self.added):
            if worker_id in registered:
                self._starting.pop(worker_id, None)
            elif worker_id not in self._starting:
                self.added.remove((role, worker_id))
            elif self._clock() - self._starting[worker_id] >= self.config.placement.timeout_s:
                log.warning("%s did not register within %.0fs: given up", worker_id,
                            self.config.placement.timeout_s)
                self.stop(worker_id, wait=False)
                self.added.remove((role, worker_id))
                del self._starting[worker_id]
                given_up.append(worker_id)
        return given_up

    def add(self, role: str) -> str:
        from deploy.deployment import WorkerPlace, _start_worker

        worker_id = self._next_id(role)
        name = f"{self.config.name}-{worker_id}-pg"
        ranks = self.config.tp_for(role)
        group = placement_group([self.config.workers.bundle] * ranks, strategy="STRICT_PACK",
                                name=name, lifetime="detached")
        _start_worker(self.config, WorkerPlace(group, 0, name if ranks > 1 else None), role,
                      worker_id, self.router["registry_address"])
        self.added.append((role, worker_id))
        self._starting[worker_id] = self._clock()
        return worker_id

    def _next_id(self, role: str) -> str:
        taken = set(ray.util.list_named_actors())
        index = 0
        while f"{self.config.name}-{role}-{index}" in taken:
            index += 1
        return f"{role}-{index}"

    def remove(self, role: str, registered: frozenset[str]) -> str:
        """Drain one worker of `role` through the router (its running requests move with their
        KV), wait until it holds nothing, stop it. One not registered yet is just stopped."""
        worker_id = self._victim(role, registered)
        try:
            if worker_id in registered:
                self._wait_empty(worker_id)
        finally:  # whatever happened, it must not stay drained and idle
            self.stop(worker_id, wait=worker_id in registered)
            self.added = [a for a in self.added if a[1] != worker_id]
            self._starting.pop(worker_id, None)
        return worker_id

    def _victim(self, role: str, registered: frozenset[str]) -> str:
        """The newest worker added, else the highest-numbered registered one of the role."""
        for added_role, worker_id in reversed(self.added):
            if added_role == role:
                return worker_id
        status = cluster_status(self.router["address"], RPC_TIMEOUT_S, self.root_ca)
        ids = [w.worker_id for w in status.workers
               if ROLE_NAMES.get(w.role) == role and not w.draining]
        return max(ids, key=lambda i: int(i.rsplit("-", 1)[-1]) if i[-1].isdigit() else -1)

    def _drain(self, worker_id: str) -> int:
        """Ask the router to drain it (again: idempotent); the streams still running there."""
        with internal_channel(self.router["registry_address"], self.root_ca) as channel:
            return pb_grpc.RouterAdminStub(channel).DrainWorker(
                pb.DrainWorkerRequest(worker_id=worker_id), timeout=RPC_TIMEOUT_S
            ).running_streams

    def _wait_empty(self, worker_id: str) -> None:
        """Until the drained worker streams nothing through the router (its moves done) and
        holds nothing, within its grace."""
        deadline = self._clock() + self.config.workers.grace_s
        while self._clock() < deadline:
            streams = self._drain(worker_id)
            status = cluster_status(self.router["address"], RPC_TIMEOUT_S, self.root_ca)
            worker = next((w for w in status.workers if w.worker_id == worker_id), None)
            if worker is None or (not streams and not worker.running_requests
                                  and not worker.waiting_requests
                                  and not worker.queued_prompt_tokens
                                  and worker.free_blocks == worker.total_blocks):
                return
            time.sleep(0.25)
        log.warning("%s still held requests after %.0fs of draining; stopping it anyway",
                    worker_id, self.config.workers.grace_s)

    def stop(self, worker_id: str, wait: bool) -> None:
        """Drain and stop a worker's actor (`wait`), kill it, remove its own placement group."""
        try:
            actor = ray.get_actor(f"{self.config.name}-{worker_id}")
        except ValueError:
            actor = None
        if actor is not None:
            if wait:
                try:
                    ray.get(actor.stop.remote(),
                            timeout=self.config.workers.grace_s + RPC_TIMEOUT_S)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
                    log.warning("%s did not stop cleanly (%s): killed", worker_id, exc)
            ray.kill(actor, no_restart=True)
        try:
            remove_placement_group(get_placement_group(f"{self.config.name}-{worker_id}-pg"))
        except ValueError:  # one of the deployment's first workers: its bundle stays reserved
            pass
