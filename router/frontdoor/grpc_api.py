"""The router's public gRPC service (pdserve.v1.Generation): translates proto <-> domain; policy
lives in the Frontend (validation), the Orchestrator and the PlacementPolicy."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from common.grpc_server import call_budget_s
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.fleet.registry_service import ROLE_TO_PROTO
from router.frontdoor.choices import choice_forks, expand_grpc
from router.frontdoor.detokenizer import IncrementalText
from router.frontdoor.lenient import Unparsable, lenient
from router.frontdoor.request_log import RequestLog, RequestRecord
from router.frontdoor.validation import Frontend, Job
from router.metrics import RouterMetrics
from router.policy.admission import Admission, LeftQueue, QueueFull
from router.policy.placement import PlacementPolicy
from router.request.calls import DEFAULT_TIMEOUT_S, CallScope, RouterError
from router.request.events import Finished, Tokens
from router.request.forks import ForkRole
from router.request.orchestrator import Orchestrator
from router.request.stream_driver import WAITING, Waiting

log = logging.getLogger(__name__)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, orchestrator: Orchestrator,
                 placement: PlacementPolicy, admission: Admission, metrics: RouterMetrics,
                 metrics_address: str = "", default_timeout_s: float = DEFAULT_TIMEOUT_S):
        self.frontend = frontend
        self.orchestrator = orchestrator
        self.placement = placement
        self.admission = admission
        self.metrics = metrics
        self.metrics_address = metrics_address
        self.default_timeout_s = default_timeout_s  # a request whose client set no deadline
        self.requests = RequestLog(metrics)
        self.http_address = ""  # the OpenAI-compatible HTTP API, when served
        self.draining = threading.Event()

    def Generate(self, request: pb.GenerateRequest | Unparsable, context: grpc.ServicerContext
                 ) -> Iterator[pb.GenerateResponse]:
        if _several_choices(request):
            yield from self._generate_choices(request, context)
            return
        record = RequestRecord("grpc")
        scope = CallScope(call_budget_s(context.time_remaining(), self.default_timeout_s))
        if not context.add_callback(scope.cancel):
            scope.cancel()  # the client was gone before this handler ran
        try:
            yield from self.stream(request, scope, record)
        except RouterError as exc:
            context.abort(exc.code, exc.message)
        finally:
            scope.cancel()  # whatever ended it, nothing keeps running on the workers
            self.requests.finish(record, scope.expired())

    def _generate_choices(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                          ) -> Iterator[pb.GenerateResponse]:
        """A batch or n > 1: each choice a generation of its own on a thread, their messages
        interleaved with their index; the first failure ends them all."""
        try:
            choices = expand_grpc(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        scope = CallScope(call_budget_s(context.time_remaining(), self.default_timeout_s))
        if not context.add_callback(scope.cancel):
            scope.cancel()  # the client was gone before this handler ran
        records = [RequestRecord("grpc") for _ in choices]
        forks = choice_forks(request.n, request.sampling, len(choices))
        merged: queue.Queue = queue.Queue()
        for index, (choice, record) in enumerate(zip(choices, records)):
            threading.Thread(target=self._run_choice,
                             args=(index, choice, scope, record, merged, forks[index]),
                             name=f"choice-{index}", daemon=True).start()
        try:
            for item in _until_all_end(merged, len(choices), scope):
                if isinstance(item, RouterError):
                    context.abort(item.code, item.message)
                yield item
        finally:
            scope.cancel()  # whatever ended it, no choice keeps running on the workers
            for record in records:
                self.requests.finish(record, scope.expired())

    def _run_choice(self, index: int, choice: pb.GenerateRequest, scope: CallScope,
                    record: RequestRecord, merged: queue.Queue, fork: ForkRole | None) -> None:
        try:
            for response in self.stream(choice, scope, record, fork=fork):
                response.index = index
                merged.put(response)
        except RouterError as exc:
            merged.put(exc)
        finally:
            merged.put(CHOICE_END)

    def stream(self, request: pb.GenerateRequest | Unparsable, scope: CallScope,
               record: RequestRecord, on_accepted: Callable[[Job], None] | None = None,
               rest_of_context: bool = False, fork: ForkRole | None = None
               ) -> Iterator[pb.GenerateResponse | Waiting]:
        """A request's responses, whatever the front end (gRPC here, HTTP in http_api):
        RouterError ends it with a status; `scope` carries its deadline and cancellation;
        `record` learns how it ended; `on_accepted` hears when it leaves the router's queue
        for a slot (the HTTP API then sends its status and headers); `rest_of_context`:
        without max_tokens, generate up to the model's context (OpenAI chat's default);
        `fork`: its part among the samples of its prompt (router.request.forks). Driven by a
        StreamDriver it also yields WAITING while its decode stream has nothing to read."""
        try:
            yield from self._accept(request, scope, record, on_accepted, rest_of_context, fork)
        except RouterError as exc:
            record.failed(exc.code, exc.message)
            raise
        except Exception as exc:  # a bug, not the request: INTERNAL with its cause
            log.exception("request %s failed", record.request_id)
            record.failed(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
            raise RouterError(grpc.StatusCode.INTERNAL, f"internal error: {exc}") from exc
        finally:
            if fork is not None and fork.leads:  # never published: its samples go on alone
                fork.group.give_up()

    def _accept(self, request: pb.GenerateRequest | Unparsable, scope: CallScope,
                record: RequestRecord, on_accepted: Callable[[Job], None] | None,
                rest_of_context: bool, fork: ForkRole | None
                ) -> Iterator[pb.GenerateResponse | Waiting]:
        arrival = record.arrival
        if isinstance(request, Unparsable):
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        record.request_id = request.request_id
        if self.draining.is_set():
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              "the router is draining: it takes no new requests")
        try:
            job = self.frontend.parse(request, arrival, rest_of_context)
        except ValueError as exc:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        record.request_id, record.prompt_tokens = job.request_id, len(job.token_ids)
        if fork is not None:
            job = dataclasses.replace(job, fork=fork)
            if not fork.leads:  # before its slot: the leader must never wait behind it
                fork.group.wait(scope)
        self._enter(scope, len(job.token_ids))
        try:
            if on_accepted is not None:
                on_accepted(job)
            yield from self._stream(job, scope, time.monotonic() - arrival, record)
        finally:
            self.admission.leave()

    def _enter(self, scope: CallScope, prompt_tokens: int) -> None:
        try:
            self.admission.enter(scope.deadline, scope.cancelled, cost=prompt_tokens)
        except QueueFull as exc:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded: {exc}") from None
        except LeftQueue as exc:
            if exc.reason == "cancelled" and not scope.expired():
                raise RouterError(grpc.StatusCode.CANCELLED, "cancelled while queued") from None
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline "
                              "passed while it waited in the router's queue") from None

    def _stream(self, job: Job, scope: CallScope, router_queue_s: float, record: RequestRecord
                ) -> Iterator[pb.GenerateResponse | Waiting]:
        p = job.params
        text = IncrementalText(self.frontend.tokenizer, job.token_ids, p.stop, p.min_tokens,
                               p.skip_special_tokens, p.include_stop_str_in_output,
                               self.frontend.stop_token_ids(p))
        output: list[str] = []  # the text so far, for tool calls
        completion_tokens = 0
        first_token_time = last_token_time = None
        for event in self.orchestrator.run(job, scope):
            if event is WAITING:  # driven by the HTTP front door (router.request.stream_driver)
                yield event
                continue
            now = time.monotonic()
            if isinstance(event, Tokens):
                if first_token_time is None:
                    first_token_time = now
                    record.ttft_s = now - job.arrival
                    self.metrics.ttft.observe(now - job.arrival)
                else:
                    self.metrics.itl.observe(now - last_token_time)
                last_token_time = now
                completion_tokens += len(event.token_ids)
                record.completion_tokens = completion_tokens
                delta = text.add(event.token_ids)
                output.append(delta)
                yield pb.GenerateResponse(request_id=job.request_id, token_ids=event.token_ids,
                                          text=delta, logprobs=event.logprobs,
                                          prompt_logprobs=event.prompt_logprobs)
            else:
                self.metrics.e2e.observe(now - job.arrival)
                last = self._last(job, event, text, completion_tokens, first_token_time)
                if job.tools is not None:  # the calls in the whole output
                    _, calls = job.tools.calls("".join(output) + last.text)
                    last.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name,
                                                       arguments=c.arguments) for c in calls)
                last.timings.router_queue_s = router_queue_s
                self.metrics.observe_phases(last.timings)
                record.code = grpc.StatusCode.OK
                record.prefill_site, record.kv_transport = event.prefill_site, event.kv_transport
                yield last

    def _last(self, job: Job, end: Finished, text: IncrementalText, completion_tokens: int,
              first_token_time: float | None) -> pb.GenerateResponse:
        now = time.monotonic()
        return pb.GenerateResponse(
            request_id=job.request_id, text=text.finish(), finish_reason=end.finish_reason,
            stop_reason=end.stop_reason,
            usage=pb.Usage(prompt_tokens=len(job.token_ids),
                           completion_tokens=completion_tokens, cached_tokens=end.cached_tokens),
            timings=pb.Timings(
                queue_s=max(0.0, end.prefill_started - job.arrival),
                ttft_s=(first_token_time or now) - job.arrival, e2e_s=now - job.arrival,
                kv_transfer_s=end.kv_transfer_s, kv_transfer_bytes=end.kv_transfer_bytes,
                kv_transport=end.kv_transport, prefill_site=end.prefill_site,
                prefill_queue_s=end.prefill_queue_s, prefill_compute_s=end.prefill_compute_s,
                decode_admission_s=end.decode_admission_s,
                prefill_tensor_parallel_size=end.tensor_parallel[0],
                decode_tensor_parallel_size=end.tensor_parallel[1],
                live_migrations=end.live_migrations,
                live_migration_bytes=end.live_migration_bytes,
                live_migration_pause_s=end.live_migration_pause_s))

    def Complete(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> pb.CompleteResponse:
        if _several_choices(request):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Complete answers one choice: use "
                          "Generate for a batch or n > 1 (its messages carry their index)")
        reply = pb.CompleteResponse()
        for part in self.Generate(request, context):
            reply.request_id = part.request_id
            reply.token_ids.extend(part.token_ids)
            reply.text += part.text
            reply.logprobs.extend(part.logprobs)
            reply.prompt_logprobs.extend(part.prompt_logprobs)
            reply.tool_calls.extend(part.tool_calls)
            if part.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                reply.finish_reason = part.finish_reason
                reply.stop_reason = part.stop_reason
                reply.usage.CopyFrom(part.usage)
                reply.timings.CopyFrom(part.timings)
        return reply

    def GetClusterStatus(self, request: pb.ClusterStatusRequest, context: grpc.ServicerContext
                         ) -> pb.ClusterStatus:
        registry = self.placement.registry
        workers = []
        for w in sorted(registry.snapshot(), key=lambda w: w.worker_id):
            age = registry.seconds_since_heartbeat(w)
            workers.append(pb.WorkerStatus(
                worker_id=w.worker_id, role=ROLE_TO_PROTO[w.role], address=w.address,
                healthy=age <= registry.heartbeat_timeout_s,
                queued_prompt_tokens=self.placement.queued_tokens(w),
                running_requests=w.load.running_requests,
                waiting_requests=w.load.waiting_requests,
                free_blocks=max(0, self.placement.free_blocks(w)),
                total_blocks=w.load.total_blocks, seconds_since_heartbeat=age,
                draining=bool(w.leaving), metrics_address=w.metrics_address, host_id=w.host_id,
                kv_device=w.kv_device, kv_transport=w.kv_transport,
                tensor_parallel_size=w.tensor_parallel_size, kv_layout=w.kv_layout))
        return pb.ClusterStatus(model=self.frontend.model_name, workers=workers,
                                queued_requests=self.admission.queued,
                                running_requests=self.admission.running,
                                metrics_address=self.metrics_address,
                                http_address=self.http_address)

    def Tokenize(self, request: pb.TokenizeRequest | Unparsable, context: grpc.ServicerContext
                 ) -> pb.TokenizeResponse:
        return self._tokenizer_call(self.frontend.tokenize, request, context)

    def Detokenize(self, request: pb.DetokenizeRequest | Unparsable,
                   context: grpc.ServicerContext) -> pb.DetokenizeResponse:
        return self._tokenizer_call(self.frontend.detokenize, request, context)

    @staticmethod
    def _tokenizer_call(call: Callable[[Any], Any], request: Any,
                        context: grpc.ServicerContext) -> Any:
        if isinstance(request, Unparsable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            return call(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


CHOICE_END = object()  # one choice's messages are over
WAIT_MARGIN_S = 5.0  # past the request's deadline, a choice's thread has surely answered


def _several_choices(request: pb.GenerateRequest | Unparsable) -> bool:
    return not isinstance(request, Unparsable) and (
        request.n > 1 or request.WhichOneof("input") == "batch")


def _until_all_end(merged: queue.Queue, count: int, scope: CallScope
                   ) -> Iterator[pb.GenerateResponse | RouterError]:
    """The choices' messages as they come, until every choice has ended or one failed."""
    while count:
        wait_s = max(0.0, scope.deadline - time.monotonic()) + WAIT_MARGIN_S
        try:
            item = merged.get(timeout=wait_s)
        except queue.Empty:
            yield RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
            return
        if item is CHOICE_END:
            count -= 1
            continue
        yield item
        if isinstance(item, RouterError):
            return


def add_generation_servicer(servicer: GenerationServicer, server: grpc.Server) -> None:
    """Like the generated `add_GenerationServicer_to_server`, but requests are deserialized
    leniently: an oversized or malformed one reaches the servicer as `Unparsable` and is
    answered INVALID_ARGUMENT naming the field, instead of gRPC's bare INTERNAL."""
    request = lenient(pb.GenerateRequest)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=request,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Complete": grpc.unary_unary_rpc_method_handler(
            servicer.Complete, request_deserializer=request,
            response_serializer=pb.CompleteResponse.SerializeToString),
        "GetClusterStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetClusterStatus,
            request_deserializer=pb.ClusterStatusRequest.FromString,
            response_serializer=pb.ClusterStatus.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize, request_deserializer=lenient(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString),
        "Detokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Detokenize, request_deserializer=lenient(pb.DetokenizeRequest),
            response_serializer=pb.DetokenizeResponse.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
