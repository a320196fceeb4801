"""Cluster membership by a shared secret: every internal RPC (registration, heartbeats, Reserve,
Prefill, Decode, ReceiveKV, Abort) carries the cluster token, and servers refuse a call without
the right one with UNAUTHENTICATED (compared in constant time). The public Generation API, health
and reflection stay open.

The token comes from `--cluster-token-file PATH` (any process) or the `PDSERVE_CLUSTER_TOKEN`
environment variable — never from the command line, where `ps` shows it. A process that has one
attaches it to every channel it opens (`common.grpc_server.channel`) and checks it on its
internal services (`start_server(..., internal=...)`): `configure` is called once, at start.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import grpc

from security.tls import ClusterTls

log = logging.getLogger(__name__)
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
METADATA_KEY = "x-pdserve-cluster-token"
MIN_TOKEN_CHARS = 16
_token: str | None = None
_tls: ClusterTls | None = None


def load_token(path: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The cluster token from `path`, else from the environment; None when neither is set
    (ValueError for an unreadable file or a token shorter than MIN_TOKEN_CHARS)."""
    if path:
        try:
            file = Path(path)
            token = file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--cluster-token-file {path}: {exc.strerror or exc}") from exc
        if file.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("cluster token file %s is readable by other users (chmod 600 it)", path)
        source = f"--cluster-token-file {path}"
    else:
        token = env.get(TOKEN_ENV, "").strip()
        source = TOKEN_ENV
        if not token:
            return None
    # ASCII: gRPC metadata carries no other characters (each call would fail INTERNAL).
    if len(token) < MIN_TOKEN_CHARS or not (token.isprintable() and token.isascii()):
        raise ValueError(f"the cluster token ({source}) must be at least {MIN_TOKEN_CHARS} "
                         f"printable ASCII characters, got {len(token)}")
    return token


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def warn_if_exposed(what: str, host: str, credential: str | ClusterTls | None,
                    plaintext: bool = False) -> str | None:
    """The warning for a server bound beyond loopback (logged and returned), or None: its
    public API in plaintext (`plaintext`: no TLS and no explicit --insecure), and anyone who
    reaches it able to join the cluster (no `credential`: neither token nor cluster mTLS)."""
    if is_loopback(host) or not (plaintext or not credential):
        return None
    problems = []
    if plaintext:
        problems.append("its public API is plaintext (give --tls-cert/--tls-key, or --insecure "
                        "to say that is intended)")
    if not credential:
        problems.append("ANY process that reaches it may join the cluster or call its internal "
                        "RPCs (set --cluster-token-file or PDSERVE_CLUSTER_TOKEN, or "
                        "--cluster-cert/--cluster-key/--cluster-ca)")
    message = f"{what} binds {host}: " + "; ".join(problems)
    log.warning(message)
    return message


def new_token() -> str:
    return secrets.token_urlsafe(32)


def configure(token: str | None, tls: ClusterTls | None = None) -> None:
    """This process's cluster credentials: its token (None: internal calls carry none) and its
    mutual-TLS certificate (None: internal connections are not mutually authenticated)."""
    global _token, _tls
    _token, _tls = token, tls


def current() -> str | None:
    return _token


def current_tls() -> ClusterTls | None:
    return _tls


class TokenAttacher(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the cluster token to every call of a channel."""

    def __init__(self, token: str):
        self._metadata = (METADATA_KEY, token)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._metadata]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready,  # noqa: ANN001
                 compression):  # noqa: ANN001
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (
            credentials, wait_for_ready, compression)


class TokenCheck(grpc.ServerInterceptor):
    """Refuses calls to `services` (full names) that do not carry `token`."""

    def __init__(self, token: str, services: Iterable[str],
                 on_refused: Callable[[str], None] | None = None):
        self._token = token.encode()
        self._services = frozenset(services)
        self._on_refused = on_refused

    def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
        service = details.method.rsplit("/", 2)[-2] if details.method.count("/") >= 2 else ""
        if service not in self._services:
            return continuation(details)
        given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if hmac.compare_digest(given.encode(), self._token):
            return continuation(details)
        handler = continuation(details)
        if self._on_refused is not None:
            # The method's name is the caller's choice: a method no service has is counted
            # under one label, or names without a token would grow the metrics without bound.
            self._on_refused(details.method if handler is not None else "unknown")
        reason = "no cluster token" if not given else "wrong cluster token"
        return _refusal(handler, f"{details.method}: {reason} (UNAUTHENTICATED)")


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    def abort(request, context: grpc.ServicerContext):  # noqa: ANN001, ANN202
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            abort, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        abort, request_deserializer=handler.request_deserializer if handler else None,
        response_serializer=handler.response_serializer if handler else None)
