"""The SLO-driven autoscaler: a detached actor (`{name}-autoscaler`) that every
`autoscale.interval_s` reads the router (deploy.signals), asks the policy (deploy.scaling) and
carries the decision out on Ray — unless `autoscale.dry_run`, when it only logs it.

- **add** / **remove**: deploy.scaled_workers (a worker in a placement group of its own; a
  worker drained through the router — its running requests move with their KV — then
  stopped). The policy never takes a role below its minimum (>= 1), and brings one below it
  back.
- the router's local prefill (conditional disaggregation) is set through
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

from common.grpc_server import internal_channel
from deploy.config import DeployConfig
from deploy.scaled_workers import ScaledWorkers
from deploy.scaling import Bounds, ScalingPolicy, Signals, SplitScore
from deploy.signals import RouterSignals
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
        self.policy.hold_off()  # a restarted controller does not know when it last acted
        self.workers = ScaledWorkers(config, router, root_ca)
        self._router_local_prefill = ""  # the mode last set on the router ("": never)
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=DECISIONS_KEPT)
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
        for worker_id in self.workers.settle(read.registered):
            self.decisions.append({"time": time.time(), "error": f"{worker_id} did not "
                                   f"register within {self.config.placement.timeout_s:g}s; "
                                   "given up"})
        workers = dict(read.workers)
        for role, count in self.workers.starting().items():
            workers[role] = workers.get(role, 0) + count
        signals = dataclasses.replace(read, workers=workers)
        decision = self.policy.decide(signals)
        record: dict[str, Any] = {"time": time.time(), "inputs": _inputs(signals),
                                  **decision.as_dict(),
                                  "dry_run": self.config.autoscale.dry_run}
        if decision.action != "hold" or decision.local_prefill is not None:
            log.info("autoscaler: %s %s (%s)", decision.action, decision.role, decision.reason)
        if not self.config.autoscale.dry_run:
            self._set_local_prefill(self.policy.local_prefill)
            if decision.action == "add":
                record["worker_id"] = self.workers.add(decision.role)
            elif decision.action == "remove":
                record["worker_id"] = self.workers.remove(decision.role, read.registered)
        self.decisions.append(record)
        return record

    def _set_local_prefill(self, mode: str) -> None:
        """The router's local prefill as the policy wants it: set when it changed, and again
        every interval while it is off (a restarted router starts from auto)."""
        if mode == self._router_local_prefill and mode == "auto":
            return
        with internal_channel(self.router["registry_address"], self.root_ca) as channel:
            pb_grpc.RouterAdminStub(channel).SetLocalPrefill(
                pb.SetLocalPrefillRequest(mode=mode), timeout=RPC_TIMEOUT_S)
        self._router_local_prefill = mode


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
        return list(self.autoscaler.workers.added)

    def stop(self) -> bool:
        self.autoscaler.stop()
        return True
