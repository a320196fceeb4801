"""The Ray actors: each hosts one process of the cluster — the router or a worker — built from the
same code the local launcher runs (router.server.Router, serving.worker_main.WorkerProcess).

An actor that dies (its process killed, its node gone) is restarted by Ray up to max_restarts;
its constructor runs again, so a worker loads its engine and registers with the router again,
and a router binds its fixed port again and rebuilds its registry from the workers' heartbeats
(a worker the new router does not know registers again on its next beat).

Credentials come as paths (deploy.security.Credentials): each actor reads the token, its TLS
certificate and key and the CAs from its own node's files."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

import ray

from deploy.config import NODE_IP
from deploy.security import NO_CREDENTIALS, Credentials


def _host(setting: str) -> str:
    return ray.util.get_node_ip_address() if setting == NODE_IP else setting


def _router_security(credentials: Credentials, internal_port: int) -> dict[str, Any]:
    """RouterOptions fields from the credential files, read here, on the router's node."""
    from security.auth import load_token
    from security.tls import ClusterTls, ServerTls

    tls, mutual = credentials.tls, credentials.cluster_tls
    cluster_tls = ClusterTls.load(mutual.cert_file, mutual.key_file, mutual.ca_file)
    return {"cluster_token": load_token(credentials.token_file),
            "tls": ServerTls.load(tls.cert_file, tls.key_file), "cluster_tls": cluster_tls,
            "internal_port": internal_port if cluster_tls else None}


def _worker_security(credentials: Credentials) -> dict[str, Any]:
    """WorkerOptions fields from the credential files, read here, on the worker's node."""
    from security.auth import load_token
    from security.tls import ClusterTls

    mutual = credentials.cluster_tls
    return {"cluster_token": load_token(credentials.token_file),
            "tls_ca": credentials.tls.ca_file,
            "cluster_tls": ClusterTls.load(mutual.cert_file, mutual.key_file, mutual.ca_file)}


def _placement() -> dict[str, Any]:
    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(), "restarted": context.was_current_actor_reconstructed}


class RouterActor:
    def __init__(self, host: str, port: int, model: str, max_running: int, max_queued: int,
                 http_port: int = 8000, credentials: Credentials = NO_CREDENTIALS,
                 internal_port: int = 50052):
        from engine.gc_heap import freeze_startup_heap
        from router.server import Router, RouterOptions

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.router = Router(RouterOptions(host=_host(host), port=port, model=model,
                                           max_running=max_running, max_queued=max_queued,
                                           http_port=http_port,
                                           **_router_security(credentials, internal_port)))
        freeze_startup_heap()  # as `router serve` does: this actor's process routes until it ends
        self.port = self.router.start()
        self.address = f"{self.router.options.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        """`registry_address`: where workers register (the internal port under mutual TLS)."""
        return {"role": "router", "id": "router", "address": self.address,
                "registry_address": self.router.internal_address or self.address,
                "metrics_address": self.router.metrics_address,
                "http_address": self.router.http_address, **_placement()}

    def stop(self) -> bool:
        """Drain (in-flight streams finish within the grace period), then stop serving."""
        from engine.gc_heap import thaw_heap

        drained = self.router.drain()
        self.router.stop(1.0)
        thaw_heap()
        return drained


def _exit_for_restart(reason: str) -> None:
    logging.getLogger(__name__).error("the engine cannot run any more (%s): exiting so that "
                                      "Ray restarts this worker", reason)
    os._exit(1)


class RankActor:
    """Rank 1.. of a tensor-parallel worker, in a bundle of its worker's placement group (on
    rank 0's node): it joins rank 0 over rank 0's socket and runs every step rank 0 sends. It
    ends with its rank — when rank 0 says stop or is gone — and is never restarted: a lost rank
    takes its worker down as a unit (Ray restarts the worker actor, which starts new ranks)."""

    def __init__(self, spec: Any, rank: int, address: str, authkey: bytes):
        from engine.tp_ranks import rank_main

        def run() -> None:
            code = 1
            try:
                rank_main(spec, rank, address, authkey)
                code = 0
            finally:  # the rank is over (stopped, rank 0 gone, or failed): so is this actor
                os._exit(code)

        threading.Thread(target=run, name=f"tp-rank-{rank}", daemon=True).start()

    def pid(self) -> int:
        return os.getpid()


class RayRank:
    """Rank 0's handle on one RankActor (engine.tp_ranks.RankProcess): alive until a probe of
    it fails (it could not be placed or started, or it died)."""

    def __init__(self, actor: Any):
        self.actor = actor
        self._probe = actor.pid.remote()
        self._dead = ""

    def alive(self) -> bool:
        if self._dead:
            return False
        ready, _ = ray.wait([self._probe], timeout=0)
        if ready:
            try:
                ray.get(self._probe)
            except ray.exceptions.RayError as exc:
                self._dead = type(exc).__name__
                return False
            self._probe = self.actor.pid.remote()  # ask again next time
        return True

    def describe(self) -> str:
        return f"a Ray actor{f' ({self._dead})' if self._dead else ''}"

    def stop(self, timeout_s: float) -> None:
        ray.kill(self.actor, no_restart=True)


class RayRankLauncher:
    """Starts a worker's ranks 1.. as actors in its placement group's bundles 1.. (rank 0, the
    worker actor, holds bundle 0; STRICT_PACK keeps them on its node). The ranks are owned by the
    worker actor, so they go when it goes."""

    def __init__(self, group_name: str, num_cpus: int):
        self.group_name, self.num_cpus = group_name, num_cpus
        self.started: list[RayRank] = []

    def start(self, spec: Any, rank: int, address: str, authkey: bytes) -> RayRank:
        from ray.util.placement_group import get_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = get_placement_group(self.group_name)
        actor = ray.remote(RankActor).options(
            max_restarts=0, num_cpus=self.num_cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank),
        ).remote(dataclasses.replace(spec, threads=self.num_cpus), rank, address, authkey)
        self.started.append(RayRank(actor))
        return self.started[-1]


class WorkerActor:
    def __init__(self, role: str, worker_id: str, router_address: str, host: str,
                 engine: dict[str, Any], grace_s: float, connect_timeout_s: float,
                 credentials: Credentials = NO_CREDENTIALS, rank_group: str | None = None):
        from decode_worker.role import decode_role
        from prefill_worker.role import prefill_role
        from serving.options import WorkerOptions
        from serving.worker_main import WorkerProcess, build_engine

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        # A restarted worker may find the router restarting too: wait for it as long as a
        # deployment may take to come up (a constructor that fails is not restarted again).
        options = WorkerOptions(role=role, router=router_address, host=_host(host),
                                worker_id=worker_id, grace_s=grace_s,
                                connect_timeout_s=connect_timeout_s,
                                **_worker_security(credentials), **engine)
        launcher = RayRankLauncher(rank_group, options.threads) if rank_group else None
        llm_engine = build_engine(options, rank_launcher=launcher)
        worker_role = (prefill_role if role == "prefill" else decode_role)(llm_engine, options)
        # An engine that cannot run any more (a tensor-parallel rank died) ends this actor's
        # process: Ray restarts it with a whole engine, and the router moves its requests.
        worker_role.loop.on_fatal = _exit_for_restart
        self.worker = WorkerProcess(options, worker_role, llm_engine.model_path.name)
        self._ranks = [] if launcher is None else list(launcher.started)
        self.role, self.worker_id = role, worker_id
        self._stopped = threading.Event()

    def info(self) -> dict[str, Any]:
        """`rank_pids`: the processes of its tensor-parallel ranks 1.. (rank actors)."""
        try:
            pids = ray.get([rank.actor.pid.remote() for rank in self._ranks], timeout=10)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pids = []  # a rank is gone: this actor is about to end too
        return {"role": self.role, "id": self.worker_id, "address": self.worker.address,
                "metrics_address": self.worker.metrics_address, "rank_pids": pids,
                **_placement()}

    def stop(self) -> bool:
        """Drain (accepted requests finish within the grace period), then stop serving."""
        if self._stopped.is_set():
            return True
        self._stopped.set()
        self.worker.drain()
        left = self.worker.role.in_flight()
        self.worker.close()
        return left == 0
