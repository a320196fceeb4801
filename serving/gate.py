"""What a worker's servicers accept: nothing new once it drains, nothing past its queue limit.
Every refusal is counted (by method and status code) before the RPC is aborted."""

from __future__ import annotations

import logging
import threading
from typing import NoReturn

import grpc

from serving.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class Gate:
    def __init__(self, worker_id: str, metrics: WorkerMetrics, max_queued_requests: int):
        self.worker_id = worker_id
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.draining = threading.Event()

    def reject(self, context: grpc.ServicerContext, method: str, code: grpc.StatusCode,
               message: str) -> NoReturn:
        self.note_refused(method, code.name, message)
        context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

    def note_refused(self, method: str, code: str, message: str) -> None:
        """Count and log a refusal (a servicer of another layer aborts the RPC itself)."""
        self.metrics.reject(method, code)
        log.warning("refused %s: %s", method, message, extra={"fields": {
            "worker_id": self.worker_id, "method": method, "status": code}})

    def check_new(self, context: grpc.ServicerContext, method: str) -> None:
        """Refuse a new request while draining (work already accepted still completes)."""
        if self.draining.is_set():
            self.reject(context, method, grpc.StatusCode.UNAVAILABLE,
                        f"worker {self.worker_id} is draining: it takes no new requests")


class QueueFull(Exception):
    """The worker's own queue is at its limit (RESOURCE_EXHAUSTED: place it elsewhere)."""


def check_queue(waiting: int, limit: int) -> None:
    if waiting >= limit:
        raise QueueFull(f"{waiting} requests already wait on this worker; the limit is {limit} "
                        "(--max-queued-requests)")
