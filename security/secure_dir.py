"""`router launch --secure DIR`: a secure local cluster in one flag.

The first launch writes into DIR a throwaway CA and a certificate for the launch host (what
`python -m router certs` writes; usable for server and client authentication) and a random
cluster token (mode 0600); later launches reuse them, so clients keep trusting the same CA. The
cluster then runs with TLS on the router's public ports, mutual TLS between every process and
the cluster token on every internal call — the same as naming each file with its own flag.
"""

from __future__ import annotations

import os
from pathlib import Path

TOKEN_FILE = "cluster.token"
FLAGS = ("tls_cert", "tls_key", "tls_ca", "cluster_cert", "cluster_key", "cluster_ca",
         "cluster_token_file")


def secure_files(directory: Path, hosts: list[str]) -> dict[str, str]:
    """ClusterSpec's credential fields for a cluster secured by the files in `directory`
    (created when missing; the certificate names `hosts`, 127.0.0.1 and localhost)."""
    from security.auth import new_token

    directory.mkdir(parents=True, exist_ok=True)
    cert, key, ca = directory / "server.pem", directory / "server.key", directory / "ca.pem"
    _write_certs(directory, list(dict.fromkeys([*hosts, "127.0.0.1", "localhost"])))
    token = directory / TOKEN_FILE
    if not token.is_file():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(new_token() + "\n")
    files = dict(tls_cert=cert, tls_key=key, tls_ca=ca, cluster_cert=cert, cluster_key=key,
                 cluster_ca=ca, cluster_token_file=token)
    return {name: str(path) for name, path in files.items()}


def _write_certs(directory: Path, hosts: list[str]) -> None:
    """The CA and a certificate for `hosts` in `directory`: kept while they serve; the
    certificate issued again by the same CA (clients keep trusting it) once it is about to
    expire or lacks a host; all of it anew when the CA itself is about to expire."""
    from security.certs import VALID_DAYS, issue, make_certs, unusable_because

    cert, key = directory / "server.pem", directory / "server.key"
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    if not all(path.is_file() for path in (cert, key, ca)):
        make_certs(directory, hosts)
        return
    why = unusable_because(cert, hosts)
    if why is None:
        return
    if ca_key.is_file() and unusable_because(ca, [], margin_days=VALID_DAYS / 2) is None:
        print(f"--secure: {why}: issuing it again from {ca}", flush=True)
        issue(directory, "server", ca, ca_key, hosts, VALID_DAYS)
        return
    print(f"--secure: {why}, and the CA is near its end: a new CA (clients must trust the "
          f"new {ca})", flush=True)
    make_certs(directory, hosts)


def check_no_credential_flags(given: dict[str, object]) -> None:
    """--secure brings its own files: naming one of them too is a mistake worth stopping on."""
    named = [f"--{name.replace('_', '-')}" for name in FLAGS if given.get(name)]
    if named:
        raise ValueError(f"--secure writes and uses its own certificates and token; drop "
                         f"{', '.join(named)} (or drop --secure)")
