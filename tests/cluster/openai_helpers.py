"""Helpers of the HTTP API tests: a raw HTTP call and a gRPC Complete on the shared cluster."""

from __future__ import annotations

import http.client
import json

from common.grpc_server import channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

PROMPT = "The quick brown fox jumps over the lazy dog because"


def raw(address: str, path: str, body: dict | None = None, headers: dict | None = None,
        ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    if body is None:
        conn.request("GET", path)
    else:
        conn.request("POST", path, json.dumps(body),
                     {"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def grpc_complete(cluster, request: pb.GenerateRequest) -> pb.CompleteResponse:  # noqa: ANN001
    with channel(cluster.address) as ch:
        return pb_grpc.GenerationStub(ch).Complete(request, timeout=120)
