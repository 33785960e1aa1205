"""Every gRPC channel and server credential a Squall process uses, built from [tls] in one place.

With `[tls] enabled = false` (the default) every channel is plaintext and servers listen
without TLS, as before. With it on (docs/security.md):

* servers present `cert_dir/<own id>.crt`. Coordinators and replicas require a client
  certificate from the cluster CA at the handshake (mutual TLS); gateways, the apps'
  endpoint, do not ask for one. grpc's Python API can only require a client certificate or
  not ask for one at all, so a replica (which apps reach through replicated publisher
  proxies) requires one and such apps get a certificate from the cluster CA;
* every internal client presents its own certificate and sets `grpc.ssl_target_name_override`
  to the id of the node or gateway it dials, so the server's certificate must name that id
  (an address that is not in the file is checked against its host name instead).

Credentials are read once per process: rotating certificates means restarting services
one at a time (docs/security.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import grpc

from squall_server.common.config import ClusterConfig, TlsConfig, tls_path
from squall_server.common.tls_files import IdentityFiles, identity_paths, load_identity, read_ca

# The identity the command line presents when cert_dir holds admin.crt and admin.key.
ADMIN_ID = "admin"

Options = Sequence[tuple[str, Any]]


# Words gRPC puts in the details of a call that failed in the TLS handshake.
_HANDSHAKE_MARKERS = ("ssl", "handshake", "certificate", "hostname verification", "tls")


def handshake_failure(details: str | None) -> bool:
    """True when an UNAVAILABLE call's details say the TLS handshake failed."""
    text = (details or "").lower()
    return any(marker in text for marker in _HANDSHAKE_MARKERS)


def address_owner(config: ClusterConfig, address: str) -> str | None:
    """The id of the node or gateway listening at address, None for an address not in the file."""
    for node in config.nodes:
        if address in (node.coordinator_address, node.replica_address):
            return node.id
    for gateway in config.gateways:
        if address == gateway.address:
            return gateway.id
    return None


@functools.lru_cache(maxsize=64)
def _identity(tls: TlsConfig, identity: str) -> IdentityFiles:
    return load_identity(
        tls_path(tls.ca_file, "tls.ca_file"), tls_path(tls.cert_dir, "tls.cert_dir"), identity
    )


@functools.lru_cache(maxsize=64)
def _ca_pem(tls: TlsConfig) -> bytes:
    return read_ca(tls_path(tls.ca_file, "tls.ca_file"))[0]


@functools.lru_cache(maxsize=64)
def _push_ca_pem(tls: TlsConfig) -> bytes:
    if tls.push_ca_file is None:
        return _ca_pem(tls)
    return read_ca(tls.push_ca_file, "tls.push_ca_file")[0]


def cli_identity(config: ClusterConfig) -> str | None:
    """The identity the command line presents: `admin` when cert_dir holds its files."""
    if not config.tls.enabled or config.tls.cert_dir is None:
        return None
    cert, key = identity_paths(config.tls.cert_dir, ADMIN_ID)
    return ADMIN_ID if cert.exists() and key.exists() else None


class Transport:
    """The channels and server credentials of one process (a node, a gateway or the CLI).

    identity is the id whose certificate this process presents (None: no client
    certificate, for a CLI without admin.crt).
    """

    def __init__(self, config: ClusterConfig, identity: str | None) -> None:
        self.config = config
        self.identity = identity
        self.enabled = config.tls.enabled

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The CA to verify servers with, and this process's certificate when it has one."""
        tls = self.config.tls
        if self.identity is None:
            return grpc.ssl_channel_credentials(root_certificates=_ca_pem(tls))
        files = _identity(tls, self.identity)
        return grpc.ssl_channel_credentials(
            root_certificates=files.ca_pem,
            private_key=files.key_pem,
            certificate_chain=files.cert_pem,
        )

    def _options(self, address: str, options: Options, target: str | None) -> list[Any]:
        merged = list(options)
        name = target or address_owner(self.config, address)
        if name is not None:
            # The server must present a certificate naming the member we mean to reach.
            merged.append(("grpc.ssl_target_name_override", name))
        return merged

    def aio_channel(
        self,
        address: str,
        *,
        options: Options = (),
        interceptors: Sequence[Any] | None = None,
        target: str | None = None,
    ) -> grpc.aio.Channel:
        """An asyncio channel to address (a member's, unless target names who to expect)."""
        if not self.enabled:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(
            address,
            self.channel_credentials(),
            options=self._options(address, options, target),
            interceptors=interceptors,
        )

    def channel(
        self, address: str, *, options: Options = (), target: str | None = None
    ) -> grpc.Channel:
        """A blocking channel to address, for the command line and deploy tools."""
        if not self.enabled:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(
            address, self.channel_credentials(), options=self._options(address, options, target)
        )

    def push_channel(self, endpoint: str, *, options: Options = ()) -> grpc.aio.Channel:
        """An asyncio channel to an app's push endpoint, TLS when tls.push says so.

        An endpoint is an app's server, not a member: its certificate must name the
        endpoint's host (the usual host name check) and chain to push_ca_file (default the
        cluster CA); this replica presents its own certificate, so the app can tell that
        the cluster is calling.
        """
        tls = self.config.tls
        if not tls.push_tls:
            return grpc.aio.insecure_channel(endpoint, options=options)
        if self.identity is None:
            raise ValueError("push deliveries over TLS need an identity to present")
        files = _identity(tls, self.identity)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_push_ca_pem(tls),
            private_key=files.key_pem,
            certificate_chain=files.cert_pem,
        )
        return grpc.aio.secure_channel(endpoint, credentials, options=options)

    def server_credentials(self, *, require_client_cert: bool) -> grpc.ServerCredentials | None:
        """This process's server credentials (None while TLS is off).

        require_client_cert: coordinators and replicas (mutual TLS); gateways do not ask.
        """
        if not self.enabled:
            return None
        if self.identity is None:
            raise ValueError("a server needs an identity to present")
        files = _identity(self.config.tls, self.identity)
        return grpc.ssl_server_credentials(
            [(files.key_pem, files.cert_pem)],
            root_certificates=files.ca_pem if require_client_cert else None,
            require_client_auth=require_client_cert,
        )


def transport(config: ClusterConfig, identity: str | None) -> Transport:
    """The transport of a process presenting identity's certificate."""
    return Transport(config, identity)


def cli_transport(config: ClusterConfig | None) -> Transport | None:
    """The command line's transport: None without a config (plaintext to a given address)."""
    if config is None:
        return None
    return Transport(config, cli_identity(config))


def plain_or(transport_: Transport | None, address: str, options: Options = ()) -> grpc.Channel:
    """A blocking channel through transport_ when there is one, plaintext otherwise."""
    if transport_ is None:
        return grpc.insecure_channel(address, options=options)
    return transport_.channel(address, options=options)
