"""TLS for the client library: the cluster CA to trust, and a client certificate if any.

With `tls=TlsOptions(...)` every channel the library opens (to the gateway, and to the
replicas of a replicated publisher proxy) is TLS, verifying the server against ca_file.
The gateway does not ask for a client certificate; replicas require one from the cluster
CA (docs/security.md), so an app that publishes through replicated or non-replicated
publisher proxies gives cert_file and key_file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

# A PEM file larger than this is not a certificate or key (bound what we read).
_PEM_BYTES_MAX = 1024 * 1024


@dataclass(frozen=True)
class TlsOptions:
    """How the library connects with TLS.

    ca_file: the cluster CA (PEM) that signed the servers' certificates.
    cert_file, key_file: this app's client certificate and key (PEM), both or neither.
    server_name: the name the gateway's certificate must carry (default: the host of the
    address dialled; the gateway id when dialling it by an address its certificate does
    not name).
    """

    ca_file: str | Path
    cert_file: str | Path | None = None
    key_file: str | Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files; ValueError naming a file that cannot be used."""
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TlsOptions: give both cert_file and key_file, or neither")
        ca = _read_pem(self.ca_file, "ca_file", b"-----BEGIN CERTIFICATE-----")
        if self.cert_file is None or self.key_file is None:
            return grpc.ssl_channel_credentials(root_certificates=ca)
        key = _read_pem(self.key_file, "key_file", b"PRIVATE KEY-----")
        cert = _read_pem(self.cert_file, "cert_file", b"-----BEGIN CERTIFICATE-----")
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """A push endpoint's credentials: it serves cert_file and key_file, and requires
        the caller's certificate from ca_file (the cluster CA: only a replica gets in).
        ValueError naming what is missing or cannot be used."""
        if self.cert_file is None or self.key_file is None:
            raise ValueError(
                "TlsOptions: a PushEndpoint with TLS needs cert_file and key_file (a "
                "certificate naming the host the cluster dials)"
            )
        ca = _read_pem(self.ca_file, "ca_file", b"-----BEGIN CERTIFICATE-----")
        key = _read_pem(self.key_file, "key_file", b"PRIVATE KEY-----")
        cert = _read_pem(self.cert_file, "cert_file", b"-----BEGIN CERTIFICATE-----")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )


def _read_pem(path: str | Path, name: str, marker: bytes) -> bytes:
    file = Path(path)
    try:
        if file.stat().st_size > _PEM_BYTES_MAX:
            raise ValueError(f"TlsOptions.{name}: {file} is too large to be a PEM file")
        data = file.read_bytes()
    except OSError as error:
        raise ValueError(
            f"TlsOptions.{name}: cannot read {file}: {error.strerror or type(error).__name__}"
        ) from None
    if marker not in data:
        raise ValueError(f"TlsOptions.{name}: {file} is not PEM ({marker.decode().strip('-')})")
    return data


def open_channel(
    address: str,
    options: Sequence[tuple[str, Any]],
    tls: TlsOptions | None,
    credentials: grpc.ChannelCredentials | None,
    server_name: str | None,
) -> grpc.Channel:
    """A plaintext channel without tls, else a TLS one expecting server_name when given."""
    if tls is None or credentials is None:
        return grpc.insecure_channel(address, options=options)
    merged = list(options)
    if server_name:
        merged.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(address, credentials, options=merged)
