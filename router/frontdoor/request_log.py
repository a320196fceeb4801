"""Every client request's outcome, recorded once whichever front door it came through: the
`pdserve_router_requests_total{api,code}` counter and one access-log line (INFO when it
finished, WARNING with its cause when it failed or was refused)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from router.metrics import RouterMetrics

access_log = logging.getLogger("pdserve.access")


@dataclass
class RequestRecord:
    """What one request came to; the front door and GenerationServicer.stream fill it in."""

    api: str  # grpc | http
    arrival: float = field(default_factory=time.monotonic)
    request_id: str = ""
    code: grpc.StatusCode = grpc.StatusCode.CANCELLED  # until it finishes or fails
    cause: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    prefill_site: str = ""
    kv_transport: str = ""
    finished: bool = False  # counted and logged (once)

    def failed(self, code: grpc.StatusCode, cause: str) -> None:
        self.code, self.cause = code, cause


class RequestLog:
    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def finish(self, record: RequestRecord, expired: bool = False) -> None:
        """Count and log a request that ended (once: later calls do nothing); `expired`: its
        deadline had passed (a request gRPC cancelled for that timed out, it was not cancelled
        by its client)."""
        if record.finished:
            return
        record.finished = True
        if record.code is grpc.StatusCode.CANCELLED and expired:
            record.failed(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        if record.code is grpc.StatusCode.CANCELLED and not record.cause:
            record.cause = "the client cancelled or went away"
        self.metrics.requests.labels(record.api, record.code.name).inc()
        fields = {"request_id": record.request_id, "api": record.api,
                  "status": record.code.name, "prompt_tokens": record.prompt_tokens,
                  "output_tokens": record.completion_tokens,
                  "ttft_s": -1.0 if record.ttft_s is None else record.ttft_s,
                  "e2e_s": time.monotonic() - record.arrival,
                  "prefill_site": record.prefill_site, "kv_transport": record.kv_transport}
        if record.code is grpc.StatusCode.OK:
            access_log.info("request finished", extra={"fields": fields})
        else:
            access_log.warning("request failed: %s", record.cause,
                               extra={"fields": {**fields, "cause": record.cause}})
