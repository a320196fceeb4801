"""The domain events a request's path through the cluster yields (the servicer turns them into
proto), and the request as a retry or migration resends it."""

from __future__ import annotations

import dataclasses

from pdserve_proto import pdserve_pb2 as pb
from router.frontend import Job


@dataclasses.dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Finished:
    finish_reason: int
    stop_reason: str
    cached_tokens: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0
    kv_transport: str = ""
    prefill_started: float = 0.0
    attempts: int = 1
    prefill_site: str = ""  # remote, local or colocated (the last attempt's)


def continuation(job: Job, emitted: list[int], attempt: int) -> Job:
    """The request as attempt `attempt` sends it: after a migration, the tokens already streamed
    join the prompt and count against max_tokens (greedy output is unchanged by the move)."""
    if attempt == 1:
        return job
    params = dataclasses.replace(job.params, max_tokens=job.params.max_tokens - len(emitted))
    return dataclasses.replace(job, worker_request_id=f"{job.worker_request_id}.{attempt}",
                               token_ids=job.token_ids + emitted, params=params)
