"""A throwaway certificate authority for local TLS (`python -m router certs --out DIR`): a CA and
a server certificate it signs, for the hosts the router is reached at. For trying secure mode on
one machine or a lab cluster; production deployments bring their own PKI.

Files written (keys 0600): ca.pem, ca.key, server.pem, server.key.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
VALID_DAYS = 30


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve (local)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _certificate(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey,
                 signer: ec.EllipticCurvePrivateKey, ca: bool, hosts: list[str],
                 days: int) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(_san(hosts), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def make_certs(out: Path, hosts: list[str] | None = None, days: int = VALID_DAYS
               ) -> dict[str, Path]:
    """Write a fresh CA and a server certificate for `hosts`; the files' paths by name."""
    hosts = list(hosts or DEFAULT_HOSTS)
    if not hosts or days < 1:
        raise ValueError("certs need at least one host and days >= 1")
    out.mkdir(parents=True, exist_ok=True)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = _name("pdserve local CA")
    ca = _certificate(ca_name, ca_name, ca_key, ca_key, True, [], days)
    server = _certificate(_name(hosts[0]), ca_name, server_key, ca_key, False, hosts, days)
    pem = serialization.Encoding.PEM
    key_format = (serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    paths = {name: out / name for name in ("ca.pem", "ca.key", "server.pem", "server.key")}
    _write(paths["ca.pem"], ca.public_bytes(pem))
    _write(paths["ca.key"], ca_key.private_bytes(pem, *key_format), private=True)
    _write(paths["server.pem"], server.public_bytes(pem))
    _write(paths["server.key"], server_key.private_bytes(pem, *key_format), private=True)
    return paths
