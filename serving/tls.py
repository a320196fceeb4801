"""TLS settings, read once at the edge: a server's certificate and key, and the CA a client
trusts. PEM files; every error is a ValueError naming the flag."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


def _read(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key (the files, checked readable as PEM at load)."""

    cert_file: str
    key_file: str

    @classmethod
    def load(cls, cert_file: str | None, key_file: str | None) -> ServerTls | None:
        """None when neither is given (plaintext); ValueError when only one is."""
        if not cert_file and not key_file:
            return None
        if not (cert_file and key_file):
            raise ValueError("--tls-cert and --tls-key go together")
        _read("--tls-cert", cert_file)
        _read("--tls-key", key_file)
        return cls(cert_file, key_file)

    def key_and_chain(self) -> tuple[bytes, bytes]:
        """For grpc.ssl_server_credentials."""
        return _read("--tls-key", self.key_file), _read("--tls-cert", self.cert_file)

    def ssl_context(self) -> ssl.SSLContext:
        """For the HTTP server."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def read_ca(path: str | None) -> bytes | None:
    """The CA a client trusts (--tls-ca), or None for plaintext."""
    return _read("--tls-ca", path) if path else None
