"""The internal RouterAdmin service, for operators (`pdserve drain`) and the autoscaler: it only
translates proto <-> the registry (the move trigger does the moving) and the prefill-site
policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc

from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.fleet.registry import WorkerRegistry
from router.policy.prefill_site import PrefillSitePolicy


class RouterAdminServicer(pb_grpc.RouterAdminServicer):
    def __init__(self, registry: WorkerRegistry, running_streams: Callable[[str], int],
                 sites: PrefillSitePolicy):
        self.registry = registry
        self.running_streams = running_streams  # requests streaming from a worker now
        self.sites = sites

    def DrainWorker(self, request: pb.DrainWorkerRequest, context: grpc.ServicerContext
                    ) -> pb.DrainWorkerResponse:
        worker = self.registry.drain(request.worker_id, drained=not request.undo)
        if worker is None:
            known = ", ".join(sorted(w.worker_id for w in self.registry.snapshot())) or "none"
            context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id {request.worker_id!r} is not "
                          f"registered with this router (registered: {known})")
        return pb.DrainWorkerResponse(worker_id=worker.worker_id, draining=bool(worker.leaving),
                                      running_streams=self.running_streams(worker.worker_id))

    def SetLocalPrefill(self, request: pb.SetLocalPrefillRequest, context: grpc.ServicerContext
                        ) -> pb.SetLocalPrefillResponse:
        current = self.sites.config
        try:
            config = dataclasses.replace(current, mode=request.mode, max_local_tokens=(
                request.max_tokens or current.max_local_tokens))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.sites.config = config  # one reference swapped: requests read one config or the other
        return pb.SetLocalPrefillResponse(mode=config.mode, max_tokens=config.max_local_tokens)
