"""The router's OpenAI-compatible HTTP front door (aiohttp), beside gRPC in the same process:
`POST /v1/completions`, `POST /v1/chat/completions` (server-sent events with `stream: true`),
`GET /v1/models`, `GET /health`, `GET /metrics`.

Handlers only translate (router.openai_wire): each request runs through the same
GenerationServicer.stream as a gRPC one — same admission queue, placement, limits and metrics —
on a thread of its own, its responses handed to the event loop. A client that goes away (the
handler is cancelled, or a write fails) cancels the request's CallScope, which aborts it on its
workers; the thread then runs the request's cleanup to the end. `X-Request-Timeout` (seconds)
sets a deadline (504 past it); otherwise the gRPC API's default bounds the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
from collections.abc import AsyncIterator

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve_proto import pdserve_pb2 as pb
from router import openai_wire as wire
from router.calls import CallScope, RouterError
from router.registry import Role
from router.service import GenerationServicer

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0
DONE = object()  # the end of a request's responses


class HttpApi:
    def __init__(self, servicer: GenerationServicer, host: str, port: int,
                 ssl_context: ssl.SSLContext | None = None):
        self.servicer = servicer
        self.ssl_context = ssl_context  # HTTPS when set
        self.frontend = servicer.frontend
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
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
        app = web.Application(client_max_size=8 << 20)
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
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
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.frontend.model_name, "object": "model", "created": 0,
            "owned_by": "pdserve", "max_model_len":
                self.frontend.model_config.max_position_embeddings}]})

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

    # ---- generation ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, http: web.Request, chat: bool) -> web.StreamResponse:
        try:
            api = wire.parse(await _json(http), chat, self.frontend.model_name)
            if chat and not api.max_tokens_given:
                self._fill_context(api.request)
            scope = CallScope(_timeout(http))
        except wire.ApiError as exc:
            return _error(exc)
        code = grpc.StatusCode.CANCELLED  # unless it finishes or fails with a status
        responses = self._run(api.request, scope)
        try:
            first = await anext(responses)
            if isinstance(first, RouterError):
                code = first.code
                return _error(wire.ApiError.from_status(first.code, first.message))
            reply = await (self._sse(http, api, first, responses) if api.stream
                           else self._json_reply(api, first, responses))
            code = grpc.StatusCode.OK
            return reply
        except (asyncio.CancelledError, ConnectionError):
            scope.cancel()  # the client went away: abort on the workers
            raise
        finally:
            self.servicer.metrics.requests.labels(code.name).inc()

    def _fill_context(self, request: pb.GenerateRequest) -> None:
        """Chat without a max: the rest of the context (what vLLM does)."""
        try:
            prompt = len(self.frontend.tokens(request))
        except ValueError as exc:
            raise wire.ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        limit = self.frontend.model_config.max_position_embeddings
        request.sampling.max_tokens = max(1, limit - prompt)

    async def _run(self, request: pb.GenerateRequest, scope: CallScope
                   ) -> AsyncIterator[pb.GenerateResponse | RouterError]:
        """The request's responses from a thread driving GenerationServicer.stream; a
        RouterError ends them."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def drive() -> None:
            try:
                for response in self.servicer.stream(request, scope):
                    loop.call_soon_threadsafe(queue.put_nowait, response)
            except RouterError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            except Exception as exc:  # noqa: BLE001 - reported to the client as a 500
                log.exception("HTTP request %s failed", request.request_id)
                loop.call_soon_threadsafe(queue.put_nowait, RouterError(
                    grpc.StatusCode.INTERNAL, f"internal error: {exc}"))
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, DONE)

        threading.Thread(target=drive, name=f"http-{request.request_id}", daemon=True).start()
        while (item := await queue.get()) is not DONE:
            yield item
            if isinstance(item, RouterError):
                return

    async def _json_reply(self, api: wire.ApiRequest, first: pb.GenerateResponse,
                          responses: AsyncIterator) -> web.Response:
        parts = [first]
        async for item in responses:
            if isinstance(item, RouterError):
                return _error(wire.ApiError.from_status(item.code, item.message))
            parts.append(item)
        last = parts[-1]
        text = "".join(p.text for p in parts)
        logprobs = [lp for p in parts for lp in p.logprobs]
        choice = {"index": 0, "finish_reason": wire.FINISH.get(last.finish_reason),
                  "logprobs": wire.logprobs_json(api, logprobs, self._token_text)}
        if api.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = wire.envelope(api, api.request.request_id, self.frontend.model_name, False)
        body.update(choices=[choice], usage=wire.usage(last), timings=wire.timings(last))
        return web.json_response(body)

    async def _sse(self, http: web.Request, api: wire.ApiRequest, first: pb.GenerateResponse,
                   responses: AsyncIterator) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                            "Cache-Control": "no-cache"})
        await reply.prepare(http)
        if api.chat:
            await _event(reply, self._chunk(api, {"delta": {"role": "assistant", "content": ""}}))
        item: pb.GenerateResponse | RouterError = first
        offset = 0
        while True:
            if isinstance(item, RouterError):
                error = wire.ApiError.from_status(item.code, item.message)
                await _event(reply, error.body())
                break
            await self._send_part(reply, api, item, offset)
            offset += len(item.text)
            if item.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                if api.include_usage:
                    await _event(reply, self._chunk(api, None, usage=wire.usage(item)))
                break
            item = await anext(responses)
        await reply.write(b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply

    async def _send_part(self, reply: web.StreamResponse, api: wire.ApiRequest,
                         item: pb.GenerateResponse, offset: int) -> None:
        finished = item.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        if not (item.text or item.logprobs or finished):
            return  # a token that completes no character yet: nothing to say
        choice: dict = {"logprobs": wire.logprobs_json(api, list(item.logprobs),
                                                       self._token_text, offset),
                        "finish_reason": wire.FINISH.get(item.finish_reason) if finished
                        else None}
        if api.chat:
            choice["delta"] = {"content": item.text} if item.text else {}
        else:
            choice["text"] = item.text
        extra = {"timings": wire.timings(item)} if finished else {}
        await _event(reply, self._chunk(api, choice, **extra))

    def _chunk(self, api: wire.ApiRequest, choice: dict | None, **extra: object) -> dict:
        body = wire.envelope(api, api.request.request_id, self.frontend.model_name, True)
        body["choices"] = [] if choice is None else [{"index": 0, **choice}]
        if api.include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    def _token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False)


async def _json(http: web.Request) -> object:
    try:
        return await http.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise wire.ApiError(400, f"the request body is not valid JSON: {exc}") from exc


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
    await reply.write(f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode())
