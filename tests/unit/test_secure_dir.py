"""`router launch --secure DIR`: one flag writes (once) and wires a throwaway CA, certificate and
cluster token for TLS, mutual TLS and token authentication."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509

from cli.cluster import _parser, launch_spec
from deploy.__main__ import load_config
from deploy.config import DeployConfig
from deploy.security import with_secure_dir


def spec(*argv: str):
    return launch_spec(_parser().parse_args(["launch", *argv]))


def test_secure_dir_is_written_once_and_wires_every_credential(tmp_path):
    first = spec("--secure", str(tmp_path / "sec"))
    sec = tmp_path / "sec"
    assert first.tls_cert == first.cluster_cert == str(sec / "server.pem")
    assert first.tls_key == first.cluster_key == str(sec / "server.key")
    assert first.tls_ca == first.cluster_ca == str(sec / "ca.pem")
    assert first.cluster_token_file == str(sec / "cluster.token")
    for private in ("server.key", "ca.key", "cluster.token"):
        assert stat.S_IMODE((sec / private).stat().st_mode) == 0o600, private
    token, ca = (sec / "cluster.token").read_text(), (sec / "ca.pem").read_bytes()
    assert len(token.strip()) >= 32
    cert = x509.load_pem_x509_certificate((sec / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    spec("--secure", str(sec))  # a second launch reuses them: clients keep the same CA
    assert (sec / "cluster.token").read_text() == token and (sec / "ca.pem").read_bytes() == ca


def test_secure_refuses_credentials_named_beside_it(tmp_path):
    with pytest.raises(ValueError, match="drop --tls-cert, --tls-key, --cluster-token-file"):
        spec("--secure", str(tmp_path), "--tls-cert", "a.pem", "--tls-key", "a.key",
             "--cluster-token-file", "t")


def test_deploy_secure_dir_fills_the_credential_sections(tmp_path):
    yaml = tmp_path / "d.yaml"
    yaml.write_text("router:\n  host: node-ip\n")
    config = load_config(yaml, None)
    assert not config.tls.enabled and config.cluster_token_file is None
    secured = with_secure_dir(config, tmp_path / "sec", node_ip="10.9.8.7")
    assert secured.tls.cert_file == secured.cluster_tls.cert_file == str(tmp_path / "sec" /
                                                                          "server.pem")
    assert secured.tls.ca_file == secured.cluster_tls.ca_file
    assert secured.cluster_token_file == str(tmp_path / "sec" / "cluster.token")
    cert = x509.load_pem_x509_certificate((tmp_path / "sec" / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "10.9.8.7" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert isinstance(secured, DeployConfig)
    with pytest.raises(ValueError, match="--secure brings its own credentials; the config "
                                         "names cluster_token_file, tls, cluster_tls"):
        with_secure_dir(secured, tmp_path / "other", node_ip="10.9.8.7")


def test_a_certificate_near_its_end_or_missing_a_host_is_issued_again_by_the_same_ca(tmp_path):
    """Reused as they were, a certificate past its 30 days (or one for other hosts) failed
    every handshake of every later launch."""
    import datetime

    from security.certs import issue, unusable_because

    sec = tmp_path / "sec"
    spec("--secure", str(sec))
    ca = (sec / "ca.pem").read_bytes()
    hosts = ["127.0.0.1", "localhost"]
    assert unusable_because(sec / "server.pem", hosts) is None
    old = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=40)
    issue(sec, "server", sec / "ca.pem", sec / "ca.key", hosts, 30, start=old)  # expired
    assert "expires" in unusable_because(sec / "server.pem", hosts)
    spec("--secure", str(sec))
    assert unusable_because(sec / "server.pem", hosts) is None
    assert (sec / "ca.pem").read_bytes() == ca  # clients keep trusting the same CA
    assert "does not name 10.1.2.3" in unusable_because(sec / "server.pem", ["10.1.2.3"])
    spec("--secure", str(sec), "--host", "10.1.2.3")
    assert unusable_because(sec / "server.pem", ["10.1.2.3", *hosts]) is None
