"""The deployment's credentials: paths of files each actor reads on its own node. The config names
only paths, never a secret: Ray would pickle a secret into every actor's arguments and show it
in its dashboard and logs. No ray and no grpc here: the schema is checked without a cluster."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DeployConfigLike = Any  # deploy.config.DeployConfig (which imports this module)
NODE_IP = "node-ip"  # a host setting meaning "the address of the node the actor runs on"


class ConfigError(ValueError):
    """A deployment config that cannot be deployed; the message names the key."""


def _check_named(section: str, values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value == "":
            raise ConfigError(f"{section}.{key} must be a path (or null)")


@dataclass(frozen=True)
class TlsSection:
    """TLS on the router's public ports (gRPC and HTTP): its certificate and key, and the CA
    that signed it, which the workers (when they register on the public port) and the deploy
    driver (`status`, waiting for registration) check the router against."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        _check_named("tls", {"cert_file": self.cert_file, "key_file": self.key_file,
                             "ca_file": self.ca_file})
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("tls.cert_file and tls.key_file go together (got only "
                              f"tls.{'cert_file' if self.cert_file else 'key_file'})")
        if self.cert_file and not self.ca_file:
            raise ConfigError("tls.ca_file is needed with tls.cert_file: the workers and the "
                              "deploy driver check the router's certificate against it")
        if self.ca_file and not self.cert_file:
            raise ConfigError("tls.ca_file without tls.cert_file and tls.key_file: the router "
                              "would serve plaintext")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass(frozen=True)
class ClusterTlsSection:
    """Mutual TLS between the actors: each one's certificate and key (one pair may serve all,
    as `python -m router certs` writes it) and the cluster CA every peer must chain to."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        named = {"cert_file": self.cert_file, "key_file": self.key_file,
                 "ca_file": self.ca_file}
        _check_named("cluster_tls", named)
        missing = [f"cluster_tls.{key}" for key, value in named.items() if not value]
        if 0 < len(missing) < 3:
            raise ConfigError(f"cluster_tls.cert_file, key_file and ca_file go together "
                              f"(missing {', '.join(missing)})")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass(frozen=True)
class Credentials:
    """What the actors get: paths only, read by each actor on its node."""

    token_file: str | None = None
    tls: TlsSection = TlsSection()
    cluster_tls: ClusterTlsSection = ClusterTlsSection()


NO_CREDENTIALS = Credentials()  # plaintext, no token: for 127.0.0.1 only


def with_secure_dir(config: DeployConfigLike, directory: Path, node_ip: str | None
                    ) -> DeployConfigLike:
    """`python -m deploy up --secure DIR`: the config with a throwaway CA, certificate and
    cluster token kept in DIR (written the first time, as `router launch --secure` does) as its
    tls, cluster_tls and cluster_token_file. The certificate names the router's and the workers'
    hosts ("node-ip" stands for `node_ip`): for one node, or a DIR every node sees at that path.
    The config must not name credentials of its own."""
    from security.secure_dir import secure_files

    named = [key for key, on in (("cluster_token_file", config.cluster_token_file),
                                 ("tls", config.tls.enabled),
                                 ("cluster_tls", config.cluster_tls.enabled)) if on]
    if named:
        raise ConfigError(f"--secure brings its own credentials; the config names "
                          f"{', '.join(named)} too")
    hosts = [node_ip if h == NODE_IP else h for h in (config.router.host, config.workers.host)]
    files = secure_files(directory, [h for h in hosts if h])
    pair = {"cert_file": files["tls_cert"], "key_file": files["tls_key"],
            "ca_file": files["tls_ca"]}
    return dataclasses.replace(config, cluster_token_file=files["cluster_token_file"],
                               tls=TlsSection(**pair), cluster_tls=ClusterTlsSection(**pair))
