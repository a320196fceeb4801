"""TLS inputs without a server: the throwaway CA's certificates, and bad files refused with the
flag named."""

from __future__ import annotations

import ipaddress

import pytest
from cryptography import x509

from security.certs import make_certs
from security.tls import ServerTls, read_ca


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


def test_the_certificate_serves_both_ends_and_issue_sets_its_validity(tmp_path):
    import datetime

    from cryptography.x509.oid import ExtendedKeyUsageOID

    from security.certs import issue

    paths = make_certs(tmp_path)
    server = x509.load_pem_x509_certificate(paths["server.pem"].read_bytes())
    usage = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    start = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    old = issue(tmp_path, "old", paths["ca.pem"], paths["ca.key"], ["127.0.0.1"], 2, start=start)
    cert = x509.load_pem_x509_certificate(old["old.pem"].read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(paths["ca.pem"].read_bytes()))
    assert cert.not_valid_after_utc == start + datetime.timedelta(days=2)


def test_cluster_tls_takes_all_three_files_or_none(tmp_path):
    from router.server import RouterOptions
    from security.tls import ClusterTls

    paths = make_certs(tmp_path)
    cert, key, ca = (str(paths[n]) for n in ("server.pem", "server.key", "ca.pem"))
    assert ClusterTls.load(None, None, None) is None
    tls = ClusterTls.load(cert, key, ca)
    assert tls is not None and tls.channel_credentials() is not None
    with pytest.raises(ValueError, match="--cluster-cert, --cluster-key and --cluster-ca go"):
        ClusterTls.load(cert, key, None)
    with pytest.raises(ValueError, match="--cluster-ca"):
        ClusterTls.load(cert, key, str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="--cluster-cert needs --internal-port"):
        RouterOptions(cluster_tls=tls)
    with pytest.raises(ValueError, match="--internal-port must be in"):
        RouterOptions(internal_port=70000)


def test_a_key_that_is_not_the_certificates_is_refused_naming_both_flags(tmp_path):
    """gRPC took such a pair and then failed the bind ("Failed to bind to address")."""
    from security.tls import ClusterTls

    one, other = make_certs(tmp_path / "one"), make_certs(tmp_path / "other")
    with pytest.raises(ValueError, match="--tls-key .* is not the key of --tls-cert"):
        ServerTls.load(str(one["server.pem"]), str(other["server.key"]))
    with pytest.raises(ValueError, match="--cluster-key .* is not the key of --cluster-cert"):
        ClusterTls.load(str(one["server.pem"]), str(other["server.key"]), str(one["ca.pem"]))
    assert ClusterTls.load(str(one["server.pem"]), str(one["server.key"]), str(one["ca.pem"]))
