"""Deploy, inspect and tear down a cluster on a running Ray cluster.

Everything is a named, detached Ray object in the config's namespace, so `status` and `down` work
from any later driver: the placement group `{name}-pg` (one bundle per worker, the configured
strategy), the router actor `{name}-router` (pinned to the head node, fixed port), and one actor
per worker, `{name}-prefill-0`, `{name}-decode-0`, ... each in its own bundle. A worker of N
tensor-parallel ranks has a placement group of its own instead, `{name}-{worker id}-pg`: N
bundles, STRICT_PACK (its ranks share memory, so one node); the worker actor (rank 0) takes the
first and starts its ranks 1.. as actors in the others (deploy.actors.RayRankLauncher)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy.actors import RouterActor, WorkerActor
from deploy.config import ConfigError, DeployConfig
from deploy.scaled_workers import worker_pattern

log = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource
AUTOSCALER = "autoscaler"  # its actor is `{name}-autoscaler`
CALL_TIMEOUT_S = 10.0


class DeployError(RuntimeError):
    """The deployment could not be started (nothing is left running) or inspected."""


@dataclass(frozen=True)
class Deployment:
    name: str
    router_address: str
    actors: list[dict[str, Any]]  # each actor's info(): role, id, address, node, pid


def connect(config: DeployConfig) -> None:
    if not ray.is_initialized():
        ray.init(address=config.ray.address, namespace=config.ray.namespace,
                 log_to_driver=False)
    namespace = ray.get_runtime_context().namespace
    if namespace != config.ray.namespace:  # placement groups are found in the driver's only
        raise DeployError(f"this driver is connected to Ray namespace {namespace!r}, the config "
                          f"names {config.ray.namespace!r}")


def check_fits(config: DeployConfig, nodes: list[dict[str, Any]]) -> None:
    """Sizes the Ray cluster can never satisfy are errors before anything starts (a placement
    group that cannot be placed would otherwise just wait)."""
    alive = [n for n in nodes if n.get("Alive")]
    bundles = sum(config.tp_for(role) for role, _ in config.worker_names)
    bundle = config.workers.bundle
    for resource, per_worker in bundle.items():
        have = sum(n["Resources"].get(resource, 0) for n in alive)
        if have < per_worker * bundles:
            raise ConfigError(f"{bundles} worker ranks x {per_worker} {resource} = "
                              f"{per_worker * bundles:g} {resource}, but the Ray cluster has "
                              f"{have:g}")
    for ranks in sorted({config.tp_for(role) for role, _ in config.worker_names}):
        if not any(all(n["Resources"].get(r, 0) >= v * ranks for r, v in bundle.items())
                   for n in alive):
            raise ConfigError(f"no node of the Ray cluster can hold one worker of {ranks} "
                              f"rank(s) ({ranks} x {bundle}: its ranks share one node)")
    head = next((n for n in alive if HEAD_RESOURCE in n["Resources"]), None)
    if head is None or head["Resources"].get("CPU", 0) < config.router.num_cpus:
        raise ConfigError(f"router.num_cpus is {config.router.num_cpus:g} but the head node, "
                          f"where the router runs, has "
                          f"{0 if head is None else head['Resources'].get('CPU', 0):g} CPUs")
    spread = sum(config.tp_for(role) == 1 for role, _ in config.worker_names)
    if config.placement.strategy == "STRICT_SPREAD" and len(alive) < spread:
        raise ConfigError(f"placement.strategy STRICT_SPREAD puts each of the {spread} "
                          f"single-rank workers on its own node, but the Ray cluster has "
                          f"{len(alive)} nodes")


def deploy(config: DeployConfig) -> Deployment:
    """Start the router and the workers; wait until every worker has registered. On any failure
    whatever was started is torn down before the error is raised."""
    connect(config)
    check_fits(config, ray.nodes())
    if _existing(config):
        raise DeployError(f"deployment {config.name!r} is already running in namespace "
                          f"{config.ray.namespace!r}: tear it down first")
    try:
        places = _placement_groups(config)
        router = _start_router(config)
        info = ray.get(router.info.remote(), timeout=config.placement.timeout_s)
        workers = [_start_worker(config, places[worker_id], role, worker_id,
                                 info["registry_address"])
                   for role, worker_id in config.worker_names]
        infos = ray.get([w.info.remote() for w in workers], timeout=config.placement.timeout_s)
        _wait_registered(info["address"], len(workers), config.placement.timeout_s,
                         router_ca(config))
        if config.autoscale.enabled:  # its start (SLO, profile read on its node) must succeed
            scaler = _start_autoscaler(config, info)
            ray.get(scaler.decisions.remote(), timeout=config.placement.timeout_s)
    except BaseException as exc:
        try:
            teardown(config)
        except Exception as cleanup:  # the start error is the one to raise; log this one
            log.warning("tearing down deployment %r after a failed start failed too: %s",
                        config.name, cleanup)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise DeployError(f"deployment {config.name!r} did not start within "
                              f"{config.placement.timeout_s:g}s; torn down") from exc
        if isinstance(exc, ray.exceptions.RayError):
            raise DeployError(f"deployment {config.name!r} failed to start ({exc}); torn "
                              "down") from exc
        raise
    return Deployment(config.name, info["address"], [info, *infos])


@dataclass(frozen=True)
class WorkerPlace:
    """Where a worker actor goes: its placement group, its bundle there, and the group's name
    when the worker's ranks 1.. take the group's other bundles."""

    group: Any
    bundle: int
    rank_group: str | None = None


def _placement_groups(config: DeployConfig) -> dict[str, WorkerPlace]:
    """worker id -> its place: workers of one rank share `{name}-pg` (a bundle each, the
    configured strategy), a worker of N ranks gets a group of N bundles of its own."""
    places: dict[str, WorkerPlace] = {}
    single = [worker_id for role, worker_id in config.worker_names if config.tp_for(role) == 1]
    if single:
        group = _ready_group(config, f"{config.name}-pg", len(single),
                             config.placement.strategy)
        places.update({worker_id: WorkerPlace(group, i) for i, worker_id in enumerate(single)})
    for role, worker_id in config.worker_names:
        if config.tp_for(role) > 1:
            name = f"{config.name}-{worker_id}-pg"
            group = _ready_group(config, name, config.tp_for(role), "STRICT_PACK")
            places[worker_id] = WorkerPlace(group, 0, name)
    return places


def group_names(config: DeployConfig) -> list[str]:
    """The deployment's placement groups: its first workers' and those of every worker with a
    group of its own (tensor-parallel, or added by the autoscaler)."""
    named = {f"{config.name}-pg"} | {f"{config.name}-{worker_id}-pg"
                                     for role, worker_id in config.worker_names
                                     if config.tp_for(role) > 1}
    workers = worker_pattern(config.name)
    named |= {g["name"] for g in ray.util.placement_group_table().values()
              if g["state"] != "REMOVED" and g["name"].endswith("-pg")
              and workers.match(g["name"].removesuffix("-pg"))}
    return sorted(named)


def _ready_group(config: DeployConfig, name: str, bundles: int, strategy: str) -> Any:
    group = placement_group([config.workers.bundle] * bundles, strategy=strategy, name=name,
                            lifetime="detached")
    try:
        ray.get(group.ready(), timeout=config.placement.timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise DeployError(f"placement group {name} ({bundles} x {config.workers.bundle}, "
                          f"{strategy}) was not placed within "
                          f"{config.placement.timeout_s:g}s") from exc
    return group


def _start_router(config: DeployConfig) -> Any:
    section = config.router
    return ray.remote(RouterActor).options(
        name=f"{config.name}-router", namespace=config.ray.namespace, lifetime="detached",
        max_restarts=section.max_restarts, max_concurrency=4, num_cpus=section.num_cpus,
        resources={HEAD_RESOURCE: 0.001},
    ).remote(section.host, section.port, config.model.path, section.max_running,
             section.max_queued, section.http_port, config.credentials, section.internal_port)


def _start_autoscaler(config: DeployConfig, router: dict[str, Any]) -> Any:
    from deploy.autoscaler import AutoscalerActor

    return ray.remote(AutoscalerActor).options(
        name=f"{config.name}-{AUTOSCALER}", namespace=config.ray.namespace, lifetime="detached",
        max_restarts=-1, max_concurrency=4, num_cpus=0, resources={HEAD_RESOURCE: 0.001},
    ).remote(config, router)


def _start_worker(config: DeployConfig, place: WorkerPlace, role: str, worker_id: str,
                  router_address: str) -> Any:
    workers = config.workers
    # On CUDA Ray gives the actor its GPU (or its part of one) as its only visible device, so
    # "cuda" is that GPU; gpus_per_worker < 1 lets several workers share one GPU.
    return ray.remote(WorkerActor).options(
        name=f"{config.name}-{worker_id}", namespace=config.ray.namespace, lifetime="detached",
        max_restarts=workers.max_restarts, max_concurrency=4, num_cpus=workers.num_cpus,
        num_gpus=workers.num_gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            place.group, placement_group_bundle_index=place.bundle),
    ).remote(role, worker_id, router_address, workers.host, config.worker_engine(role),
             workers.grace_s, config.placement.timeout_s, config.credentials, place.rank_group)


def router_ca(config: DeployConfig) -> bytes | None:
    """The CA the router's public certificate is checked against, read on this (the driver's)
    node; None when the router serves plaintext."""
    from security.tls import read_ca

    try:
        return read_ca(config.tls.ca_file)
    except ValueError as exc:
        raise ConfigError(f"tls.ca_file: {exc}") from exc


def _wait_registered(router_address: str, count: int, timeout_s: float,
                     root_ca: bytes | None = None) -> None:
    from common.client import cluster_status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if sum(w.healthy for w in cluster_status(router_address,
                                                     root_ca=root_ca).workers) >= count:
                return
        except Exception:  # the router not answering yet: keep waiting
            pass
        time.sleep(0.25)
    raise DeployError(f"{count} workers did not register with {router_address} within "
                      f"{timeout_s:g}s")


def actor_names(config: DeployConfig) -> list[str]:
    """The autoscaler (if any), every worker (the config's and those the autoscaler added),
    the router last."""
    named = {f"{config.name}-{worker_id}" for _, worker_id in config.worker_names}
    workers = worker_pattern(config.name)  # exactly: deployment "pd" is not "pd-decode"'s
    named |= {n for n in ray.util.list_named_actors() if workers.match(n)}
    scaler = [f"{config.name}-{AUTOSCALER}"] if config.autoscale.enabled or \
        f"{config.name}-{AUTOSCALER}" in ray.util.list_named_actors() else []
    return scaler + sorted(named) + [f"{config.name}-router"]


def _existing(config: DeployConfig) -> list[str]:
    return [name for name in actor_names(config) if _actor(config, name) is not None]


def _actor(config: DeployConfig, name: str) -> Any:
    try:
        return ray.get_actor(name, namespace=config.ray.namespace)
    except ValueError:
        return None


def teardown(config: DeployConfig, timeout_s: float | None = None) -> list[str]:
    """Drain and stop every actor (workers first), kill them, remove the placement group; wait
    until no actor of the deployment is left. Returns the names that were found."""
    connect(config)
    timeout_s = timeout_s or config.workers.grace_s + CALL_TIMEOUT_S
    found = [(name, actor) for name in actor_names(config)
             if (actor := _actor(config, name)) is not None]
    scalers = [actor for name, actor in found if name.endswith(f"-{AUTOSCALER}")]
    workers = [actor for name, actor in found if not name.endswith(("-router", AUTOSCALER))]
    routers = [actor for name, actor in found if name.endswith("-router")]
    # The autoscaler first (it adds no worker meanwhile), the router last (it serves until the
    # workers drained).
    for group in (scalers, workers, routers):
        stops = [actor.stop.remote() for actor in group]
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        for actor in group:
            ray.kill(actor, no_restart=True)
    for name in group_names(config):
        try:
            remove_placement_group(get_placement_group(name))
        except ValueError:  # never created
            pass
    _wait_for(lambda: not _existing(config), CALL_TIMEOUT_S * 3,
              f"actors of {config.name!r} still present after teardown")
    return [name for name, _ in found]


def _wait_for(condition: Callable[[], bool], timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise DeployError(message)
        time.sleep(0.2)


def status(config: DeployConfig) -> dict[str, Any]:
    """Nodes, every actor (its info, or why it does not answer), and the router's view."""
    from common.client import cluster_status
    from pdserve_proto import pdserve_pb2 as pb

    connect(config)
    nodes = [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "alive": n["Alive"],
              "resources": n["Resources"]} for n in ray.nodes()]
    actors = []
    names = actor_names(config)
    for name in names:
        if name.endswith(f"-{AUTOSCALER}"):
            continue
        actor = _actor(config, name)
        if actor is None:
            actors.append({"name": name, "state": "absent"})
            continue
        try:
            info = ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S)
            actors.append({"name": name, "state": "alive", **info})
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            actors.append({"name": name, "state": f"not answering ({type(exc).__name__})"})
    router = next((a for a in actors if a["name"].endswith("-router") and "address" in a), None)
    registered = []
    if router is not None:
        try:
            registered = [{"id": w.worker_id, "role": _role_name(pb, w.role),
                           "address": w.address, "healthy": w.healthy, "draining": w.draining}
                          for w in cluster_status(router["address"],
                                                  root_ca=router_ca(config)).workers]
        except Exception as exc:  # reported, not raised: status must show a broken cluster
            registered = [{"error": f"router not answering: {exc}"}]
    return {"name": config.name, "nodes": nodes, "actors": actors, "registered": registered,
            "autoscaler": _autoscaler_report(config, names)}


def _autoscaler_report(config: DeployConfig, names: list[str]) -> dict[str, Any] | None:
    """The autoscaler's last decisions with their inputs (None: the deployment has none)."""
    if f"{config.name}-{AUTOSCALER}" not in names:
        return None
    try:
        decisions = autoscaler_decisions(config)
    except DeployError as exc:
        return {"state": str(exc), "decisions": []}
    return {"state": "alive", "dry_run": config.autoscale.dry_run, "decisions": decisions[-20:]}


def autoscaler_decisions(config: DeployConfig) -> list[dict[str, Any]]:
    """Every decision the autoscaler keeps, oldest first (DeployError: it does not answer)."""
    actor = _actor(config, f"{config.name}-{AUTOSCALER}")
    if actor is None:
        raise DeployError("absent")
    try:
        return ray.get(actor.decisions.remote(), timeout=CALL_TIMEOUT_S)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
        raise DeployError(f"not answering ({type(exc).__name__})") from exc


def _role_name(pb: Any, role: int) -> str:
    return pb.WorkerRole.Name(role).removeprefix("WORKER_ROLE_").lower()
