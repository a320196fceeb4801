"""The OpenAI HTTP front door over a fake servicer (no cluster, no model): every error in
OpenAI's shape with the right status, the status and headers of a stream sent when the request
is accepted (before any token), usage on every chunk when asked, and every request counted
once with its real outcome."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest

from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.http_api import MAX_BODY_BYTES, HttpApi
from router.frontdoor.request_log import RequestLog, RequestRecord
from router.metrics import RouterMetrics
from router.request.calls import CallScope, RouterError
from router.request.stream_driver import WAITING, Park, current_driver

MODEL = "tiny"


class FakeServicer:
    """GenerationServicer.stream's contract: accept, then two token messages and a finish;
    `hold` keeps the first token back until the test releases it; `fail` ends in an error."""

    def __init__(self) -> None:
        self.frontend = SimpleNamespace(model_name=MODEL, model_config=SimpleNamespace(
            max_position_embeddings=2048), tokenizer=SimpleNamespace(
            decode=lambda ids, skip_special_tokens=False: "".join(f"<{i}>" for i in ids),
            knows_tool_calls=False))
        self.metrics = RouterMetrics()
        self.requests = RequestLog(self.metrics)
        self.default_timeout_s = 600.0
        self.hold = threading.Event()
        self.hold.set()
        self.fail: Exception | None = None
        self.park_forever = False
        self.seen: list[pb.GenerateRequest] = []

    def stream(self, request: pb.GenerateRequest, scope: CallScope, record: RequestRecord,
               on_accepted=None, rest_of_context: bool = False, fork=None
               ) -> Iterator[pb.GenerateResponse]:
        self.seen.append(request)
        record.prompt_tokens = 3
        if on_accepted is not None:
            on_accepted(SimpleNamespace(token_ids=[1, 2, 3]))
        assert self.hold.wait(30)
        if isinstance(self.fail, RouterError):
            record.failed(self.fail.code, self.fail.message)
            raise self.fail
        if self.fail is not None:  # a bug: the real servicer records INTERNAL and raises so
            record.failed(grpc.StatusCode.INTERNAL, repr(self.fail))
            raise self.fail
        yield pb.GenerateResponse(token_ids=[7], text="a")
        if self.park_forever:  # a decode stream whose last chunk never comes
            driver = current_driver()
            assert driver is not None  # the front door drives its requests
            driver.waiting_on = SimpleNamespace(park=lambda driver: Park.PARKED)
            yield WAITING
            raise AssertionError("nothing resumes it")
        yield pb.GenerateResponse(token_ids=[8, 9], text="bc")
        record.code = grpc.StatusCode.OK
        yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(
            prompt_tokens=3, completion_tokens=3))


@pytest.fixture(scope="module")
def served():
    servicer = FakeServicer()
    api = HttpApi(servicer, "127.0.0.1", 0)
    api.start()
    yield servicer, f"127.0.0.1:{api.port}"
    api.stop()


def send(address: str, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    reply = conn.getresponse()
    data = reply.read()
    conn.close()
    return reply.status, dict(reply.getheaders()), data


def post(address: str, body: dict | str, path: str = "/v1/completions", **headers: str
         ) -> tuple[int, dict]:
    raw = body if isinstance(body, str) else json.dumps(body)
    status, _, data = send(address, "POST", path, raw.encode(), headers)
    return status, json.loads(data)


def counted(servicer: FakeServicer, code: str) -> float:
    return servicer.metrics.registry.get_sample_value(
        "pdserve_router_requests_total", {"api": "http", "code": code}) or 0.0


@pytest.mark.parametrize("body, path, param", [
    ('{"model": "tiny", "prompt": "\\ud800"}', "/v1/completions", "prompt"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud800"}]}',
     "/v1/chat/completions", "messages[0].content"),
    ('{"model": "tiny", "prompt": "x", "stop": ["\\udc00"]}', "/v1/completions", "stop"),
    ('{"model": "tiny", "prompt": [4294967296]}', "/v1/completions", "prompt"),
    ('{"model": "tiny", "prompt": "x", "stop_token_ids": [8589934592]}', "/v1/completions",
     "stop_token_ids[0]"),
])
def test_input_protobuf_cannot_hold_is_a_400_naming_the_field(served, body, path, param):
    servicer, address = served
    before = counted(servicer, "INVALID_ARGUMENT")
    status, reply = post(address, body, path)
    assert status == 400 and reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith(param)
    assert counted(servicer, "INVALID_ARGUMENT") == before + 1  # counted, though refused early


def test_deep_huge_unknown_and_non_json_requests_keep_openais_shape(served):
    servicer, address = served
    status, reply = post(address, "[" * 200_000 + "]" * 200_000)
    assert status == 400 and "nests JSON deeper" in reply["error"]["message"]
    # an integer past Python's 4,300-digit limit for str -> int is Python's ValueError
    status, reply = post(address, '{"model": "tiny", "prompt": "x", "max_tokens": 1'
                         + "0" * 5000 + "}")
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    before = counted(servicer, "INVALID_ARGUMENT")
    status, headers, data = send(address, "POST", "/v1/completions",
                                 b'{"prompt": "' + b"a" * (50 << 20) + b'"}')
    error = json.loads(data)["error"]
    assert status == 413 and headers["Content-Type"].startswith("application/json")
    assert str(MAX_BODY_BYTES) in error["message"] and error["code"] == "request_too_large"
    assert counted(servicer, "INVALID_ARGUMENT") == before + 1
    status, headers, data = send(address, "GET", "/v1/nothing-here")
    assert status == 404 and json.loads(data)["error"]["type"] == "not_found_error"
    status, reply = post(address, {"model": MODEL, "prompt": "x"},
                         **{"Content-Type": "text/plain"})
    assert status == 415 and reply["error"]["param"] == "Content-Type"
    status, reply = post(address, {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"


def test_models_retrieve(served):
    _, address = served
    status, _, data = send(address, "GET", f"/v1/models/{MODEL}")
    assert status == 200 and json.loads(data)["id"] == MODEL
    status, _, data = send(address, "GET", "/v1/models/other")
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"


def test_a_stream_gets_its_status_and_headers_before_its_first_token(served):
    servicer, address = served
    servicer.hold.clear()  # no token until the headers have been read
    try:
        host, port = address.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "x", "stream": True}),
            {"Content-Type": "application/json"})
        reply = conn.getresponse()  # returns once the status line and headers arrive
        assert reply.status == 200 and reply.getheader("Content-Type") == "text/event-stream"
    finally:
        servicer.hold.set()
    events = reply.read().decode().split("\n\n")
    conn.close()
    assert events[-2] == "data: [DONE]" and json.loads(events[0][6:])["choices"][0]["text"] == "a"


def test_a_stream_failing_after_its_headers_reports_the_error_and_counts_it(served):
    servicer, address = served
    servicer.fail = RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline "
                                "passed")
    before = counted(servicer, "DEADLINE_EXCEEDED")
    try:
        status, _, data = send(address, "POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "x", "stream": True}).encode())
    finally:
        servicer.fail = None
    events = data.decode().split("\n\n")
    assert status == 200 and json.loads(events[0][6:])["error"]["type"] == "timeout_error"
    assert counted(servicer, "DEADLINE_EXCEEDED") == before + 1  # not OK


def test_continuous_usage_stats_put_usage_on_every_chunk(served):
    servicer, address = served
    status, _, data = send(address, "POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode())
    chunks = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
    assert status == 200 and all(c["usage"] is not None for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 3, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks)
    status, _, data = send(address, "POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}).encode())
    chunks = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
    assert all("usage" not in c for c in chunks)  # not asked for: not there
    before = counted(servicer, "OK")
    send(address, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode())
    assert counted(servicer, "OK") == before + 1


def test_a_body_that_cannot_be_read_is_a_400_and_a_bug_a_500_in_openais_shape(served):
    servicer, address = served
    status, _, data = send(address, "POST", "/v1/completions", b"not gzip at all",
                           {"Content-Encoding": "gzip"})
    assert status == 400 and "cannot be read" in json.loads(data)["error"]["message"]
    servicer.fail = ValueError("a bug")
    before = counted(servicer, "INTERNAL")
    try:
        status, _, data = send(address, "POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "x"}).encode())
    finally:
        servicer.fail = None
    error = json.loads(data)["error"]
    assert status == 500 and error["type"] == "server_error" and "a bug" in error["message"]
    assert counted(servicer, "INTERNAL") == before + 1


def test_a_request_whose_stream_never_ends_ends_at_its_deadline(served):
    servicer, address = served
    servicer.park_forever = True
    try:
        before = counted(servicer, "DEADLINE_EXCEEDED")
        status, body = post(address, {"model": MODEL, "prompt": "hi", "max_tokens": 3},
                            **{"X-Request-Timeout": "1"})
    finally:
        servicer.park_forever = False
    assert status == 504 and "deadline" in body["error"]["message"]
    assert counted(servicer, "DEADLINE_EXCEEDED") == before + 1


def test_a_stream_write_that_waits_past_its_limit_ends_the_handler(monkeypatch):
    # a client that keeps its connection open but reads nothing: the write never completes
    from router.frontdoor import http_api

    class Stalled:
        async def write(self, data: bytes) -> None:
            await asyncio.Event().wait()

    monkeypatch.setattr(http_api, "SSE_WRITE_TIMEOUT_S", 0.01)
    with pytest.raises(ConnectionError, match="the client read nothing for 0.01 s"):
        asyncio.run(http_api._event(Stalled(), {"a": 1}))
