"""TLS settings, read once at the edge: a server's certificate and key, the CA a client trusts,
and the cluster's mutual TLS. PEM files; every error is a ValueError naming the flag."""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


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
        _check_pair("--tls-cert", cert_file, "--tls-key", key_file)
        return cls(cert_file, key_file)

    def key_and_chain(self) -> tuple[bytes, bytes]:
        """For grpc.ssl_server_credentials."""
        return _read("--tls-key", self.key_file), _read("--tls-cert", self.cert_file)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([self.key_and_chain()])

    def ssl_context(self) -> ssl.SSLContext:
        """For the HTTP server."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def _check_pair(cert_flag: str, cert_file: str, key_flag: str, key_file: str) -> None:
    """The key is the certificate's: gRPC would otherwise fail at the bind with "Failed to bind
    to address", which reads as a port problem."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ValueError(f"{key_flag} {key_file} is not the key of {cert_flag} {cert_file} "
                         f"(or one is not a certificate or key): {exc.reason or exc}") from exc


def read_ca(path: str | None) -> bytes | None:
    """The CA a client trusts (--tls-ca), or None for plaintext."""
    return _read("--tls-ca", path) if path else None


@dataclass(frozen=True)
class ClusterTls:
    """Mutual TLS between the cluster's processes: this process's certificate and key, and the
    cluster CA every peer's certificate must chain to. Servers refuse a caller without such a
    certificate at the handshake; callers check the server's."""

    cert_file: str
    key_file: str
    ca_file: str

    @classmethod
    def load(cls, cert_file: str | None, key_file: str | None, ca_file: str | None
             ) -> ClusterTls | None:
        """None when none is given; ValueError when only some are, or one is unreadable."""
        given = [f for f in (cert_file, key_file, ca_file) if f]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError("--cluster-cert, --cluster-key and --cluster-ca go together")
        tls = cls(cert_file or "", key_file or "", ca_file or "")
        tls.server_credentials()  # every file readable as PEM now, not at the first call
        _check_pair("--cluster-cert", tls.cert_file, "--cluster-key", tls.key_file)
        return tls

    def _files(self) -> tuple[bytes, bytes, bytes]:
        return (_read("--cluster-key", self.key_file), _read("--cluster-cert", self.cert_file),
                _read("--cluster-ca", self.ca_file))

    def server_credentials(self) -> grpc.ServerCredentials:
        key, chain, ca = self._files()
        return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        key, chain, ca = self._files()
        return grpc.ssl_channel_credentials(ca, key, chain)


def add_cluster_tls_args(parser: argparse.ArgumentParser) -> None:
    """--cluster-cert/--cluster-key/--cluster-ca, the same on every process."""
    parser.add_argument("--cluster-cert", default=None,
                        help="PEM certificate of this process, signed by --cluster-ca: mutual "
                             "TLS between the cluster's processes (with --cluster-key)")
    parser.add_argument("--cluster-key", default=None, help="PEM private key of --cluster-cert")
    parser.add_argument("--cluster-ca", default=None,
                        help="PEM CA of the cluster: internal connections accept only peers "
                             "whose certificate it signed")
