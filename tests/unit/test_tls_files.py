"""TLS inputs without a server: the throwaway CA's certificates, and bad files refused with the
flag named."""

from __future__ import annotations

import ipaddress

import pytest
from cryptography import x509

from serving.certs import make_certs
from serving.tls import ServerTls, read_ca


def test_certs_are_a_ca_and_a_server_certificate_it_signed_for_the_hosts(tmp_path):
    paths = make_certs(tmp_path, ["127.0.0.1", "router.lab"])
    ca = x509.load_pem_x509_certificate(paths["ca.pem"].read_bytes())
    server = x509.load_pem_x509_certificate(paths["server.pem"].read_bytes())
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["router.lab"]
    assert paths["server.key"].stat().st_mode & 0o077 == 0  # keys are private
    tls = ServerTls.load(str(paths["server.pem"]), str(paths["server.key"]))
    assert tls is not None and tls.ssl_context() is not None
    assert read_ca(str(paths["ca.pem"])).startswith(b"-----BEGIN CERTIFICATE")


def test_bad_tls_inputs_name_their_flag(tmp_path):
    assert ServerTls.load(None, None) is None and read_ca(None) is None
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        ServerTls.load("cert.pem", None)
    not_pem = tmp_path / "x.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="--tls-ca .*not a PEM file"):
        read_ca(str(not_pem))
    with pytest.raises(ValueError, match="--tls-cert .*missing"):
        ServerTls.load(str(tmp_path / "missing"), str(not_pem))
    with pytest.raises(ValueError, match="days >= 1"):
        make_certs(tmp_path / "none", ["127.0.0.1"], days=0)
