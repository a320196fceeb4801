"""A throwaway certificate authority for local TLS (`python -m router certs --out DIR`): a CA and
a certificate it signs for the hosts the cluster is reached at. For trying secure mode on one
machine or a lab cluster; production deployments bring their own PKI.

Files written (keys 0600): ca.pem, ca.key, server.pem, server.key. The certificate serves both
ends of a TLS connection (server and client authentication), so the same files are the router's
public TLS (--tls-cert/--tls-key, clients trusting ca.pem) and every process's cluster
certificate for mutual TLS (--cluster-cert/--cluster-key/--cluster-ca).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
VALID_DAYS = 30
PEM = serialization.Encoding.PEM
KEY_FORMAT = (serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


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
                 valid: tuple[datetime.datetime, datetime.datetime]) -> x509.Certificate:
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(valid[0]).not_valid_after(valid[1])
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(_san(hosts), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                   ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _validity(days: int, start: datetime.datetime | None = None
              ) -> tuple[datetime.datetime, datetime.datetime]:
    begin = start or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    return begin, begin + datetime.timedelta(days=days)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    if not private:
        path.write_bytes(data)
        return
    # Created 0600, not chmod-ed after: the key is never readable by others, even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    path.chmod(0o600)  # a file that was there keeps its mode through O_CREAT


def unusable_because(cert_pem: Path, hosts: list[str], margin_days: float = 1.0) -> str | None:
    """Why the certificate at `cert_pem` should not serve `hosts` now: it expires within
    `margin_days`, or a host is not among its names. None when it serves."""
    cert = x509.load_pem_x509_certificate(cert_pem.read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    if cert.not_valid_after_utc < now + datetime.timedelta(days=margin_days):
        return f"{cert_pem} expires {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if not hosts:
        return None
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return f"{cert_pem} names no host"
    named = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} \
        | set(names.get_values_for_type(x509.DNSName))
    missing = [h for h in hosts if str(_host(h)) not in named]
    return f"{cert_pem} does not name {', '.join(missing)}" if missing else None


def _host(host: str) -> object:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return host


def make_certs(out: Path, hosts: list[str] | None = None, days: int = VALID_DAYS
               ) -> dict[str, Path]:
    """Write a fresh CA and a certificate for `hosts`; the files' paths by name."""
    hosts = list(hosts or DEFAULT_HOSTS)
    if not hosts or days < 1:
        raise ValueError("certs need at least one host and days >= 1")
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pdserve local CA")
    ca = _certificate(ca_name, ca_name, ca_key, ca_key, True, [], _validity(days))
    paths = {"ca.pem": out / "ca.pem", "ca.key": out / "ca.key"}
    _write(paths["ca.pem"], ca.public_bytes(PEM))
    _write(paths["ca.key"], ca_key.private_bytes(PEM, *KEY_FORMAT), private=True)
    return paths | issue(out, "server", paths["ca.pem"], paths["ca.key"], hosts, days)


def issue(out: Path, stem: str, ca_pem: Path, ca_key: Path, hosts: list[str], days: int,
          start: datetime.datetime | None = None) -> dict[str, Path]:
    """Write `stem`.pem and `stem`.key: a certificate for `hosts` signed by the CA, valid for
    `days` from `start` (default: now)."""
    ca = x509.load_pem_x509_certificate(ca_pem.read_bytes())
    signer = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(_name(hosts[0]), ca.subject, key, signer, False, hosts,
                        _validity(days, start))
    paths = {f"{stem}.pem": out / f"{stem}.pem", f"{stem}.key": out / f"{stem}.key"}
    _write(paths[f"{stem}.pem"], cert.public_bytes(PEM))
    _write(paths[f"{stem}.key"], key.private_bytes(PEM, *KEY_FORMAT), private=True)
    return paths
