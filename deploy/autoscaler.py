"""The SLO-driven autoscaler: a detached actor (`{name}-autoscaler`) that every
`autoscale.interval_s` reads the router (deploy.signals), asks the policy (deploy.scaling) and
carries the decision out on Ray — unless `autoscale.dry_run`, when it only logs it.

- **add**: a worker actor in a placement group of its own (`{name}-{worker id}-pg`), so Ray (and
  a Ray autoscaler, if the cluster has one) finds the resources; it registers with the router.
- **remove**: the router drains it (RouterAdmin.DrainWorker: nothing new is placed there, its
  running requests move with their KV to the other decode workers), then, once it holds
  nothing, the actor drains, stops and goes with its placement group. Workers this autoscaler
  added go first (newest first); the policy never takes a role below its minimum (>= 1).
- the router's local prefill (conditional disaggregation) is switched through
  RouterAdmin.SetLocalPrefill.

Every decision is kept with its inputs (the last DECISIONS_KEPT) for `deploy status`."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, remove_placement_group

from common.grpc_server import internal_channel
from deploy.config import DeployConfig
from deploy.scaling import Bounds, Decision, ScalingPolicy, Signals, SplitScore
from deploy.signals import ROLE_NAMES, RouterSignals
from loadtest.slo import SLO
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
DECISIONS_KEPT = 200
SAMPLES_PER_INTERVAL = 4  # cluster-status looks averaged into each decision
RPC_TIMEOUT_S = 10.0


def default_slo_file() -> Path:
    import loadtest

    return Path(loadtest.__file__).with_name("slo.yaml")


def planner_score(profile_file: str, workload_file: str, slo: SLO) -> SplitScore:
    """The planner's model as a split scorer: simulated goodput of P prefill and D decode
    workers at a request rate, under the SLO's latency bounds (as the planner reads them)."""
    import json

    from planner.plan import SLO as PlanSLO
    from planner.plan import evaluate, load_workload
    from planner.simulator import Profile, Topology

    profile = Profile.from_json(json.loads(Path(profile_file).read_text()))
    rows = load_workload(Path(workload_file), None)
    bounds = PlanSLO(slo.ttft.max_ms / 1000, slo.itl.max_ms / 1000)

    def score(prefill: int, decode: int, rate: float) -> float:
        topology = Topology(prefill=prefill, decode=decode)
        return evaluate(topology, profile, rows, bounds, rate, requests=200, seeds=3)["goodput"]

    return score


class Autoscaler:
    def __init__(self, config: DeployConfig, router: dict[str, Any], root_ca: bytes | None):
        section = config.autoscale
        self.config = config
        self.router = router  # the router actor's info(): addresses
        self.root_ca = root_ca
        slo = SLO.from_yaml(section.slo_file or default_slo_file())
        self.signals = RouterSignals(router["address"], router["metrics_address"], slo, root_ca)
        split = planner_score(section.profile, section.workload, slo) \
            if section.profile and section.workload else None
        self.policy = ScalingPolicy(
            slo, {r: Bounds(getattr(section, r).min, getattr(section, r).max)
                  for r in ("prefill", "decode")},
            section.cooldown_s, section.scale_down_below, section.kv_high, split,
            scale_down_window_s=section.scale_down_window_s)
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=DECISIONS_KEPT)
        self.added: list[tuple[str, str]] = []  # (role, worker id), oldest first
        self._started: dict[str, float] = {}  # added, not registered yet -> when
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        step = self.config.autoscale.interval_s / SAMPLES_PER_INTERVAL
        while True:
            for _ in range(SAMPLES_PER_INTERVAL - 1):
                if self._stopped.wait(step):
                    return
                try:
                    self.signals.sample()
                except Exception as exc:  # the read at the interval's end says it again
                    log.debug("autoscaler sample failed: %s", exc)
            if self._stopped.wait(step):
                return
            try:
                self.tick()
            except Exception as exc:  # the router restarting, say: try again next interval
                log.warning("autoscaler tick failed: %s", exc)
                self.decisions.append({"time": time.time(), "error": str(exc)})

    def tick(self) -> dict[str, Any]:
        read = self.signals.read()
        self._give_up_stuck(read.registered)
        signals = self._with_starting(read)
        decision = self.policy.decide(signals)
        record: dict[str, Any] = {"time": time.time(), "inputs": _inputs(signals),
                                  **decision.as_dict(),
                                  "dry_run": self.config.autoscale.dry_run}
        if decision.action != "hold" or decision.local_prefill is not None:
            log.info("autoscaler: %s %s (%s)", decision.action, decision.role, decision.reason)
            if not self.config.autoscale.dry_run:
                record["worker_id"] = self._apply(decision)
        self.decisions.append(record)
        return record

    def _with_starting(self, signals: Signals) -> Signals:
        """Workers added but not registered yet count too: they are on their way."""
        workers = dict(signals.workers)
        for role, worker_id in self.added:
            if worker_id not in signals.registered:
                workers[role] = workers.get(role, 0) + 1
        return dataclasses.replace(signals, workers=workers)

    def _apply(self, decision: Decision) -> str:
        if decision.local_prefill is not None:
            with self._admin() as channel:
                pb_grpc.RouterAdminStub(channel).SetLocalPrefill(
                    pb.SetLocalPrefillRequest(mode=decision.local_prefill), timeout=RPC_TIMEOUT_S)
        if decision.action == "add":
            return self._add(decision.role)
        if decision.action == "remove":
            return self._remove(decision.role)
        return ""

    def _admin(self) -> Any:
        return internal_channel(self.router["registry_address"], self.root_ca)

    def _add(self, role: str) -> str:
        """Ask Ray for the worker's resources and start it there once they exist (without
        waiting: a Ray autoscaler may take minutes to add a node)."""
        from ray.util.placement_group import placement_group

        from deploy.deployment import WorkerPlace, _start_worker

        worker_id = self._next_id(role)
        name = f"{self.config.name}-{worker_id}-pg"
        ranks = self.config.tp_for(role)
        group = placement_group([self.config.workers.bundle] * ranks, strategy="STRICT_PACK",
                                name=name, lifetime="detached")
        _start_worker(self.config, WorkerPlace(group, 0, name if ranks > 1 else None), role,
                      worker_id, self.router["registry_address"])
        self.added.append((role, worker_id))
        self._started[worker_id] = time.monotonic()
        return worker_id

    def _give_up_stuck(self, registered: frozenset[str]) -> None:
        """A worker added but not registered within placement.timeout_s (no resources came):
        its actor and placement group go, so it asks Ray for nothing more."""
        now = time.monotonic()
        for role, worker_id in list(self.added):
            if worker_id in registered:
                self._started.pop(worker_id, None)
                continue
            if now - self._started.get(worker_id, now) < self.config.placement.timeout_s:
                continue
            log.warning("%s did not register within %.0fs: given up", worker_id,
                        self.config.placement.timeout_s)
            self._stop_actor(worker_id, wait=False)
            self.added.remove((role, worker_id))
            self.decisions.append({"time": time.time(), "error": f"{worker_id} did not "
                                   f"register within {self.config.placement.timeout_s:g}s; "
                                   "given up"})

    def _next_id(self, role: str) -> str:
        taken = {name for name in ray.util.list_named_actors()}
        index = 0
        while f"{self.config.name}-{role}-{index}" in taken:
            index += 1
        return f"{role}-{index}"

    def _remove(self, role: str) -> str:
        worker_id = self._victim(role)
        with self._admin() as channel:
            pb_grpc.RouterAdminStub(channel).DrainWorker(
                pb.DrainWorkerRequest(worker_id=worker_id), timeout=RPC_TIMEOUT_S)
        self._wait_empty(worker_id)
        self._stop_actor(worker_id, wait=True)
        self.added = [a for a in self.added if a[1] != worker_id]
        return worker_id

    def _stop_actor(self, worker_id: str, wait: bool) -> None:
        """Drain and stop a worker's actor (`wait`), kill it, remove its own placement group."""
        try:
            actor = ray.get_actor(f"{self.config.name}-{worker_id}")
        except ValueError:
            actor = None
        if actor is not None:
            if wait:
                ray.get(actor.stop.remote(), timeout=self.config.workers.grace_s + RPC_TIMEOUT_S)
            ray.kill(actor, no_restart=True)
        try:
            remove_placement_group(get_placement_group(f"{self.config.name}-{worker_id}-pg"))
        except ValueError:  # one of the deployment's first workers: its bundle stays reserved
            pass

    def _victim(self, role: str) -> str:
        """The newest worker this autoscaler added, else the last-named one of the role."""
        for added_role, worker_id in reversed(self.added):
            if added_role == role:
                return worker_id
        from common.client import cluster_status

        status = cluster_status(self.router["address"], RPC_TIMEOUT_S, self.root_ca)
        ids = sorted((w.worker_id for w in status.workers
                      if ROLE_NAMES.get(w.role) == role and not w.draining),
                     key=lambda i: int(i.rsplit("-", 1)[-1]) if i[-1].isdigit() else 0)
        return ids[-1]

    def _wait_empty(self, worker_id: str) -> None:
        """Until the drained worker holds no request (its moves done), within its grace."""
        from common.client import cluster_status

        deadline = time.monotonic() + self.config.workers.grace_s
        while time.monotonic() < deadline:
            status = cluster_status(self.router["address"], RPC_TIMEOUT_S, self.root_ca)
            worker = next((w for w in status.workers if w.worker_id == worker_id), None)
            if worker is None or (not worker.running_requests and not worker.waiting_requests
                                  and not worker.queued_prompt_tokens
                                  and worker.free_blocks == worker.total_blocks):
                return
            time.sleep(0.25)
        log.warning("%s still held requests after %.0fs of draining; stopping it anyway",
                    worker_id, self.config.workers.grace_s)


def _inputs(s: Signals) -> dict[str, Any]:
    return {"ttft_ms": s.ttft_ms, "itl_ms": s.itl_ms, "queue_ms": s.queue_ms,
            "request_rate": round(s.request_rate, 3),
            "queued": s.queued, "prefill_backlog_tokens": s.prefill_backlog_tokens,
            "kv_use": round(s.kv_use, 3), "workers": dict(s.workers)}


class AutoscalerActor:
    """The autoscaler as a detached actor; `deploy status` reads its decisions. Its credentials
    are read on its node, as every actor's are."""

    def __init__(self, config: DeployConfig, router: dict[str, Any]):
        from deploy.actors import _worker_security
        from security import auth
        from security.tls import read_ca

        logging.basicConfig(level=logging.INFO)
        security = _worker_security(config.credentials)
        auth.configure(security["cluster_token"], security["cluster_tls"])
        self.autoscaler = Autoscaler(config, router, read_ca(config.tls.ca_file))
        self.autoscaler.start()

    def decisions(self) -> list[dict[str, Any]]:
        return list(self.autoscaler.decisions)

    def added(self) -> list[tuple[str, str]]:
        return list(self.autoscaler.added)

    def stop(self) -> bool:
        self.autoscaler.stop()
        return True
