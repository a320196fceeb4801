"""The domain events a request's path through the cluster yields (the servicer turns them into
proto), a decode stream read as those events, and the request as a retry or migration resends
it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import grpc

from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.validation import Job
from router.request.calls import CallScope, RouterError, worker_error
from router.request.stream_driver import WAITING, Waiting


@dataclasses.dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)
    # With the first token, when sampling.prompt_logprobs asked for them
    prompt_logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)


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
    prefill_site: str = ""  # remote, local, colocated or fork (the last attempt's)
    # Where the time to the first token went (pb.Timings), as the workers report it:
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    decode_admission_s: float = 0.0
    tensor_parallel: tuple[int, int] = (0, 0)  # the prefilling and the decoding worker's TP
    # Live moves of its KV to another decode worker (pb.Timings.live_migration_*)
    live_migrations: int = 0
    live_migration_bytes: int = 0
    live_migration_pause_s: float = 0.0

    def note_prefill(self, first: pb.PrefillResponse) -> None:
        """A prefill worker's answer: its cache hit, queue and compute, and the KV it shipped."""
        self.cached_tokens = self.cached_tokens or first.cached_tokens
        self.prefill_queue_s, self.prefill_compute_s = first.queue_s, first.prefill_s
        self.kv_transfer_s += first.kv_transfer_s
        self.kv_transfer_bytes += first.kv_transfer_bytes
        self.kv_transport = first.kv_transport or self.kv_transport

    def note_first_chunk(self, chunk: pb.TokenChunk, whole: bool) -> None:
        """A decode stream's first chunk: a whole generation's cache hit, queue and compute, or
        an admitted request's admission."""
        self.cached_tokens = self.cached_tokens or chunk.cached_tokens
        if chunk.forked:  # a sample of n that started from another's prompt KV
            self.prefill_site = "fork"
        if whole:
            self.prefill_queue_s, self.prefill_compute_s = chunk.queue_s, chunk.prefill_s
        else:
            self.decode_admission_s = chunk.admission_s


@dataclasses.dataclass
class Paused:
    """The decode worker paused the stream to move the request (its KV is parked there)."""


def continuation(job: Job, emitted: list[int], attempt: int) -> Job:
    """The request as attempt `attempt` sends it: after a migration, the tokens already streamed
    join the prompt and count against max_tokens (greedy output is unchanged by the move)."""
    if attempt == 1:
        return job
    # A retry keeps leading its samples while its prompt is unchanged; a sample that was to
    # fork retries as a generation of its own (router.request.forks).
    fork = job.fork if job.fork is not None and job.fork.leads and not emitted else None
    if emitted and job.params.structured_output is not None:
        # Its tokens so far would join the prompt and the constraint would start over.
        raise RouterError(grpc.StatusCode.UNAVAILABLE, "the worker serving this request was "
                          "lost after its first tokens; a request under structured_output "
                          "cannot continue elsewhere")
    return dataclasses.replace(_extended(job, emitted),
                               worker_request_id=f"{job.worker_request_id}.{attempt}", fork=fork)


def handover(part: Job, emitted: list[int]) -> Job:
    """The request as a live move's target reserves it: every position whose KV moves is its
    prompt (the attempt's prompt and its tokens before the last), and the last token streamed is
    the one the target decodes first, as if a prefill worker had sampled it."""
    moved = _extended(part, emitted[:-1])
    # the first token streamed went out with the prompt's logprobs: the target computes none
    return dataclasses.replace(moved, params=dataclasses.replace(moved.params,
                                                                 prompt_logprobs=None), fork=None)


def _extended(job: Job, emitted: list[int]) -> Job:
    # Tokens already streamed went out with the prompt's logprobs: the longer prompt needs none;
    # they count against max_tokens and min_tokens.
    params = dataclasses.replace(
        job.params, max_tokens=job.params.max_tokens - len(emitted),
        min_tokens=max(0, job.params.min_tokens - len(emitted)),
        prompt_logprobs=None if emitted else job.params.prompt_logprobs,
        continued_tokens=job.params.continued_tokens + len(emitted))  # penalties and seeds
    return dataclasses.replace(job, token_ids=job.token_ids + emitted, params=params)


def decode_events(worker_id: str, call: Iterator[pb.TokenChunk | Waiting],
                  message: pb.DecodeRequest, scope: CallScope, end: Finished,
                  on_first: Callable[[], None] | None, continuing: bool = False
                  ) -> Iterator[Tokens | Finished | Paused | Waiting]:
    """A decode stream's chunks as events (`on_first` runs at the first chunk). `continuing`:
    the stream goes on after a live move or a resume (its first chunk is not the request's)."""
    first = not continuing
    try:
        for chunk in call:
            if chunk is WAITING:  # driven (router.request.stream_driver): nothing to read yet
                yield WAITING
                continue
            if chunk.paused:
                yield Paused()
                return
            if on_first is not None:
                on_first()
                on_first = None
            if first:
                end.note_first_chunk(chunk, whole=not message.HasField("first_token_id"))
                first = False
            if chunk.token_ids:
                yield Tokens(list(chunk.token_ids), list(chunk.logprobs),
                             list(chunk.prompt_logprobs))
            if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                end.finish_reason, end.stop_reason = chunk.finish_reason, chunk.stop_reason
                yield end
                return
    except grpc.RpcError as exc:
        error = worker_error(exc, f"decode on {worker_id}", scope)
        error.suspect = worker_id
        raise error from exc
    raise RouterError(grpc.StatusCode.UNAVAILABLE, f"decode worker {worker_id} ended the stream "
                      "without finishing", retryable=True, suspect=worker_id)
