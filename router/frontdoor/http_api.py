"""The router's OpenAI-compatible HTTP front door (aiohttp), beside gRPC in the same process:
`POST /v1/completions`, `POST /v1/chat/completions` (server-sent events with `stream: true`),
`GET /v1/models`, vLLM's `POST /tokenize` and `POST /detokenize`, `GET /health`, `GET /metrics`.

Handlers only translate (router.frontdoor.openai_codec): each request runs through the same
GenerationServicer.stream as a gRPC one — same admission queue, placement, limits and metrics —
driven by a StreamDriver (a thread of its own until its tokens stream, then the Outputs
stream's reader: router.request.stream_driver), its responses handed to the event loop
(router.frontdoor.loop_inbox). A client that goes away (the handler is cancelled, or a write
fails) cancels the request's CallScope, which aborts it on its workers; a thread then runs the
request's cleanup to the end. `X-Request-Timeout` (seconds) sets a deadline (504 past it);
otherwise the gRPC API's default bounds the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve_proto import pdserve_pb2 as pb
from router.fleet.registry import Role
from router.frontdoor import openai_codec as wire
from router.frontdoor import tokenize_api as tokens
from router.frontdoor.choices import (
    END,
    Choice,
    Echo,
    choice_forks,
    collect,
    merged,
    total_usage,
)
from router.frontdoor.grpc_api import GenerationServicer
from router.frontdoor.loop_inbox import LoopInbox
from router.frontdoor.request_log import RequestRecord
from router.frontdoor.tool_stream import merge
from router.request.calls import CallScope, RouterError
from router.request.forks import ForkRole
from router.request.stream_driver import StreamDriver

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20  # a request body; the text inside is bounded by router.frontdoor.limits
STREAMING = web.RequestKey("streaming", bool)  # set on a request once its stream's status is out
JSON_TYPE = re.compile(r"application/([\w.+-]+\+)?json")
START_TIMEOUT_S = 30.0
# How long one write of a stream may wait for a client that reads nothing (see _write)
SSE_WRITE_TIMEOUT_S = 60.0
# past a request's deadline, when its own calls to the workers have surely failed it already
EXPIRY_MARGIN_S = 2.0
DONE = object()  # the end of a request's responses


class HttpApi:
    def __init__(self, servicer: GenerationServicer, host: str, port: int,
                 ssl_context: ssl.SSLContext | None = None):
        self.servicer = servicer
        self.ssl_context = ssl_context  # HTTPS when set
        self.frontend = servicer.frontend
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._inbox = LoopInbox(self._loop)  # the request threads' responses
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-api",
                                        daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> int:
        """Serve on host:port (0: any free port); the bound port."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = future.result(START_TIMEOUT_S)
        return self.port

    async def _start(self) -> int:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_openai_errors])
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models),
                        web.get("/v1/models/{model_id:.+}", self.model),
                        web.post("/tokenize", self.tokenize),
                        web.post("/detokenize", self.detokenize),
                        web.get("/health", self.health), web.get("/metrics", self.metrics)])
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    # ---- plain endpoints -------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.frontend.model_name, "object": "model", "created": 0,
                "owned_by": "pdserve",
                "max_model_len": self.frontend.model_config.max_position_embeddings}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """openai's `models.retrieve(id)`."""
        model_id = request.match_info["model_id"]
        if model_id != self.frontend.model_name:
            raise wire.ApiError(404, f"The model `{model_id}` does not exist; this server "
                                f"serves `{self.frontend.model_name}`", "not_found_error",
                                "model", "model_not_found")
        return web.json_response(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        registry = self.servicer.placement.registry
        decoders = registry.placeable(lambda r: r in (Role.DECODE, Role.COLOCATED))
        if self.servicer.draining.is_set() or not decoders:
            reason = "draining" if self.servicer.draining.is_set() else "no healthy worker"
            return web.json_response({"status": "unavailable", "reason": reason}, status=503)
        return web.json_response({"status": "ok", "workers": len(registry.snapshot())})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.servicer.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize (router.frontdoor.tokenize_api); off the event loop, as a long
        text takes a while to tokenize."""
        call = tokens.tokenize_request(await _json(request))
        reply = await self._tokenizer_call(self.frontend.tokenize, call)
        return web.json_response(tokens.tokenize_json(reply, call.return_token_strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        call = tokens.detokenize_request(await _json(request))
        reply = await self._tokenizer_call(self.frontend.detokenize, call, "tokens")
        return web.json_response(tokens.detokenize_json(reply))

    @staticmethod
    async def _tokenizer_call(call: Callable[[Any], Any], request: Any,
                              ids_field: str = "token_ids") -> Any:
        try:
            return await asyncio.to_thread(call, request)
        except ValueError as exc:  # the message names the gRPC field; this API's is ids_field
            message = str(exc).replace("token_ids", ids_field)
            raise wire.ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, message) from None

    # ---- generation ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, http: web.Request, chat: bool) -> web.StreamResponse:
        record = RequestRecord("http")
        try:
            api = wire.parse(await _json(http), chat, self.frontend.model_name,
                             self.frontend.tokenizer.knows_tool_calls)
            scope = CallScope(_timeout(http) or self.servicer.default_timeout_s)
        except wire.ApiError as exc:
            record.failed(wire.grpc_code(exc.status), exc.message)
            self.servicer.requests.finish(record)
            raise
        # one record per choice: each is a generation of its own
        records = [record] + [RequestRecord("http") for _ in api.all_choices[1:]]
        try:
            return await self._answer(http, api, scope, records)
        finally:
            # Finished, failed, or the client went away (CancelledError, ConnectionError): no
            # work of this request keeps running on the workers.
            scope.cancel()
            for each in records:
                self.servicer.requests.finish(each, scope.expired())

    async def _answer(self, http: web.Request, api: wire.ApiRequest, scope: CallScope,
                      records: list[RequestRecord]) -> web.StreamResponse:
        # Chat without a max: the rest of the context (what vLLM does).
        rest_of_context = api.chat and not api.max_tokens_given
        forks = choice_forks(api.n, api.request.sampling, len(api.all_choices))
        runs = [self._run(request, scope, record, rest_of_context, fork)
                for request, record, fork in zip(api.all_choices, records, forks)]
        firsts = await asyncio.gather(*(anext(run) for run in runs))
        failed = next((f for f in firsts if isinstance(f, RouterError)), None)
        if failed is not None:
            scope.cancel()  # the other choices end too
            return _error(wire.ApiError.from_status(failed.code, failed.message))
        choices = [Choice(i, run, first.prompt_token_ids,
                          self._echo(api, request, first.prompt_token_ids), i % api.n == 0,
                          tools=api.tools)
                   for i, (run, first, request) in enumerate(zip(runs, firsts, api.all_choices))]

        def done() -> None:  # the outcome is known: count it before the client reads the end
            for record in records:
                self.servicer.requests.finish(record, scope.expired())

        if not api.stream:  # a status sent early could not report a failure: it waits
            return await self._json_reply(api, choices, done)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                            "Cache-Control": "no-cache"})
        await reply.prepare(http)  # accepted: the status and headers go now, not at TTFT
        http[STREAMING] = True  # from here on an error is an SSE event, not a status
        prompt_tokens = sum(len(c.prompt_token_ids) for c in choices if c.first_sample)
        return await self._sse(reply, api, SseUsage(prompt_tokens), choices, done)

    def _echo(self, api: wire.ApiRequest, request: pb.GenerateRequest,
              prompt_token_ids: list[int]) -> Echo:
        if not api.echo:
            return Echo()
        if request.WhichOneof("input") == "prompt":
            return Echo(prompt_token_ids, request.prompt)
        return Echo(prompt_token_ids,
                    self.frontend.tokenizer.decode(prompt_token_ids, skip_special_tokens=False))

    async def _run(self, request: pb.GenerateRequest, scope: CallScope, record: RequestRecord,
                   rest_of_context: bool, fork: ForkRole | None = None
                   ) -> AsyncIterator[Accepted | pb.GenerateResponse | RouterError]:
        """The request's responses from GenerationServicer.stream, driven by a StreamDriver
        (router.request.stream_driver): on a thread of its own up to its first token (the prompt
        is tokenized there, off the event loop, so a large one holds up no other request's
        stream), then by the Outputs stream's reader as its tokens come. Accepted comes first
        when it gets a slot; a RouterError ends them."""
        queue: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:
            self._inbox.put(queue, item)

        def end(error: BaseException | None) -> None:
            if isinstance(error, RouterError):
                put(error)
            elif error is not None:  # reported to the client as a 500
                log.error("HTTP request %s failed", request.request_id, exc_info=error)
                record.failed(grpc.StatusCode.INTERNAL, f"internal error: {error!r}")
                put(RouterError(grpc.StatusCode.INTERNAL, f"internal error: {error}"))
            put(DONE)

        responses = self.servicer.stream(request, scope, record,
                                         lambda job: put(Accepted(job.token_ids)),
                                         rest_of_context=rest_of_context, fork=fork)
        StreamDriver(responses, put, end, f"http-{request.request_id}").start()
        # A parked stream has no thread waiting with a timeout: whatever it waits on (a last
        # chunk that never came), the request ends at its deadline, and the handler's cleanup
        # cancels its scope, which unwinds it on the workers.
        expiry = asyncio.get_running_loop().call_at(
            scope.deadline + EXPIRY_MARGIN_S, queue.put_nowait,
            RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"))
        try:
            while (item := await queue.get()) is not DONE:
                yield item
                if isinstance(item, RouterError):
                    return
        finally:
            expiry.cancel()

    async def _json_reply(self, api: wire.ApiRequest, choices: list[Choice],
                          done: Callable[[], None]) -> web.Response:
        failed = await collect(choices)
        done()
        if failed is not None:
            return _error(wire.ApiError.from_status(failed.code, failed.message))
        body = wire.envelope(api, api.request.request_id, self.frontend.model_name, False)
        body.update(choices=[self._whole_choice(api, c) for c in choices],
                    usage=wire.usage(total_usage(choices)),
                    timings=wire.timings(choices[0].parts[-1]))
        return web.json_response(body)

    def _whole_choice(self, api: wire.ApiRequest, choice: Choice) -> dict:
        parts = choice.parts
        text = choice.echo.text + "".join(p.text for p in parts)
        logprobs = [lp for p in parts for lp in p.logprobs]
        body = {"index": choice.index,
                "finish_reason": wire.FINISH.get(parts[-1].finish_reason),
                "logprobs": wire.logprobs_json(api, logprobs, self._token_text, 0,
                                               choice.echo.prompt_token_ids,
                                               list(parts[0].prompt_logprobs))}
        if not api.chat:
            body["text"] = text
            return body
        content, calls = api.tools.calls(text) if api.tools else (text, [])
        body["message"] = {"role": "assistant", "content": content or None if calls else content}
        if calls:
            body["message"]["tool_calls"] = [c.as_json() for c in calls]
            if body["finish_reason"] == "stop":
                body["finish_reason"] = "tool_calls"
        return body

    async def _sse(self, reply: web.StreamResponse, api: wire.ApiRequest, usage: SseUsage,
                   choices: list[Choice], done: Callable[[], None]) -> web.StreamResponse:
        if api.chat:
            extra = {"usage": usage.so_far()} if api.continuous_usage else {}
            for choice in choices:
                await _event(reply, self._chunk(api, {
                    "index": choice.index, "delta": {"role": "assistant", "content": ""}},
                    **extra))
        offsets = [0] * len(choices)
        async for choice, item in merged(choices):
            if isinstance(item, RouterError):
                done()
                await _event(reply, wire.ApiError.from_status(item.code, item.message).body())
                break
            if item is END:
                continue
            usage.completion_tokens += len(item.token_ids)
            echo, choice.echo = choice.echo, Echo()  # the prompt goes out once, first
            await self._send_part(reply, api, choice, item, offsets[choice.index],
                                  usage.so_far() if api.continuous_usage else None, echo)
            offsets[choice.index] += len(echo.text) + len(item.text)
            if item.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                choice.parts.append(item)
        else:
            done()
            if api.include_usage:
                await _event(reply, self._chunk(api, None,
                                                usage=wire.usage(total_usage(choices))))
        await _write(reply, b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply

    async def _send_part(self, reply: web.StreamResponse, api: wire.ApiRequest, choice: Choice,
                         item: pb.GenerateResponse, offset: int, usage: dict | None,
                         echo: Echo) -> None:
        finished = item.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        text = echo.text + item.text
        calls: list = []
        if api.chat:
            text, calls = choice.stream_text(text)
            if finished:
                rest, last = choice.stream_end()
                text, calls = text + rest, calls + last
        if not (text or calls or item.logprobs or echo.prompt_token_ids or finished):
            return  # a token that completes no character yet: nothing to say
        body: dict = {"index": choice.index,
                      "logprobs": wire.logprobs_json(api, list(item.logprobs),
                                                     self._token_text, offset,
                                                     echo.prompt_token_ids,
                                                     list(item.prompt_logprobs)),
                      "finish_reason": wire.FINISH.get(item.finish_reason) if finished
                      else None}
        if api.chat:
            body["delta"] = {"content": text} if text else {}
            if calls:
                body["delta"]["tool_calls"] = [c.as_json() for c in merge(calls)]
            if choice.made_calls and body["finish_reason"] == "stop":
                body["finish_reason"] = "tool_calls"
        else:
            body["text"] = text
        extra: dict[str, object] = {"timings": wire.timings(item)} if finished else {}
        if usage is not None:
            extra["usage"] = usage
        await _event(reply, self._chunk(api, body, **extra))

    def _chunk(self, api: wire.ApiRequest, choice: dict | None, **extra: object) -> dict:
        body = wire.envelope(api, api.request.request_id, self.frontend.model_name, True)
        body["choices"] = [] if choice is None else [{"index": 0, **choice}]  # index: choice's
        if api.include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    def _token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass(frozen=True)
class Accepted:
    """The request left the router's queue for a slot (its prompt is tokenized)."""

    prompt_token_ids: list[int]


@dataclass
class SseUsage:
    """Token counts so far, for stream_options.continuous_usage_stats (usage on every chunk)."""

    prompt_tokens: int
    completion_tokens: int = 0

    def so_far(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in OpenAI's shape: aiohttp's own (no such route, wrong method, a body over
    the limit) and anything unexpected, which is logged and answered 500 with its cause. A
    stream whose status and headers are out can take no second response: its error is raised."""
    try:
        return await handler(request)
    except wire.ApiError as exc:
        return _error(exc)
    except web.HTTPException as exc:
        if exc.status < 400 or request.get(STREAMING):
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return _error(wire.ApiError(exc.status, f"{request.method} {request.path}: "
                                    f"{exc.reason}", kind))
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:  # noqa: BLE001 - never a bare 500
        log.exception("HTTP %s %s failed", request.method, request.path)
        if request.get(STREAMING):
            raise
        return _error(wire.ApiError(500, f"internal error: {exc!r}", "server_error"))


async def _json(http: web.Request) -> object:
    """The body as JSON. A Content-Type, when sent, must be JSON (415 otherwise); a body sent
    without one is read as JSON, as curl users expect."""
    if http.headers.get("Content-Type") and not JSON_TYPE.fullmatch(http.content_type):
        raise wire.ApiError(415, f"Content-Type must be application/json, got "
                            f"{http.content_type!r}", param="Content-Type")
    try:
        body = await http.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise wire.ApiError(413, f"the request body is over the limit of {MAX_BODY_BYTES} "
                            f"bytes ({MAX_BODY_BYTES >> 20} MiB) ({exc.text})",
                            code="request_too_large") from None
    except (HttpProcessingError, RequestPayloadError) as exc:  # e.g. gzip that is not gzip
        raise wire.ApiError(400, f"the request body cannot be read: "
                            f"{str(exc).splitlines()[-1].strip()}") from None
    try:
        return json.loads(body)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer past Python's 4,300 digits
        raise wire.ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise wire.ApiError(400, f"the request body nests JSON deeper than the parser allows "
                            f"(about {sys.getrecursionlimit()} levels)") from None


def _timeout(http: web.Request) -> float | None:
    raw = http.headers.get("X-Request-Timeout")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 3600:
        raise wire.ApiError(400, f"X-Request-Timeout must be seconds in (0, 3600], got {raw!r}",
                            param="X-Request-Timeout")
    return seconds


def _error(exc: wire.ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _event(reply: web.StreamResponse, body: dict) -> None:
    await _write(reply, f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode())


async def _write(reply: web.StreamResponse, data: bytes) -> None:
    """One write of a stream. A client that stops reading but keeps its connection open makes
    a write wait for room in the socket's buffers: past SSE_WRITE_TIMEOUT_S this raises
    ConnectionError, which ends the handler, so the request is aborted on its workers (it
    would otherwise hold the handler, and run on, for as long as the client held on)."""
    try:
        async with asyncio.timeout(SSE_WRITE_TIMEOUT_S):
            await reply.write(data)
    except TimeoutError:
        raise ConnectionError(f"the client read nothing for {SSE_WRITE_TIMEOUT_S:g} s") from None
