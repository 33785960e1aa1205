"""A throw-away CA and one certificate per node, gateway and client (`squall certs dev`).

For testing and `make run TLS=1`, not for production (docs/security.md says how to make
real certificates). Every certificate names its id as a DNS subject alternative name (the
name peers check), plus `localhost` and the hosts of the id's addresses in the config, so
tools that dial an address rather than an id verify too. Keys are EC P-256, written 0600
in a 0700 directory; nothing is overwritten without force.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from squall_server.common.config import ClusterConfig, parse_address
from squall_server.common.names import validate_node_id
from squall_server.common.tls import ADMIN_ID
from squall_server.common.tls_files import identity_paths, write_private

CA_NAME = "ca"
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
DAYS_MAX = 3650


class CertsError(Exception):
    """`squall certs` cannot do what was asked; the message says why."""


@dataclass
class Subject:
    """One certificate to issue: its id and the extra host names and addresses it carries."""

    identity: str
    hosts: set[str] = field(default_factory=set)


def subjects(config: ClusterConfig | None, clients: list[str]) -> list[Subject]:
    """Who gets a certificate: every node and gateway of config, admin, and clients."""
    found: dict[str, Subject] = {}
    if config is not None:
        for node in config.nodes:
            subject = found.setdefault(node.id, Subject(node.id))
            for address in (node.coordinator_address, node.replica_address):
                subject.hosts.add(parse_address(address)[0])
        for gateway in config.gateways:
            subject = found.setdefault(gateway.id, Subject(gateway.id))
            subject.hosts.add(parse_address(gateway.address)[0])
    for client in [ADMIN_ID, *clients]:
        # NAME@HOST,HOST: a client that also serves a push endpoint on those hosts.
        name, _, hosts = client.partition("@")
        try:
            validate_node_id(name, "client name")
        except ValueError as error:
            raise CertsError(str(error)) from None
        if name in found:
            raise CertsError(
                f"{name!r} is already a node or gateway id in the config; a client "
                "certificate must not carry a member's name"
            )
        found[name] = Subject(name, {_host(host, client) for host in hosts.split(",") if hosts})
    if CA_NAME in found:
        raise CertsError(f"{CA_NAME!r} is reserved for the CA's own files")
    return list(found.values())


def _host(host: str, client: str) -> str:
    """A host name or IP address a client certificate names, checked."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise CertsError(f"--client {client}: {host!r} is not a host name or IP address")
    return host


def _alt_names(subject: Subject) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(subject.identity), x509.DNSName("localhost")]
    ips = {"127.0.0.1", "::1"}
    for host in sorted(subject.hosts):
        bare = host.strip("[]")
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            if host not in (subject.identity, "localhost"):
                names.append(x509.DNSName(host))
            continue
        ips.add(bare)
    names.extend(x509.IPAddress(ipaddress.ip_address(ip)) for ip in sorted(ips))
    return names


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_dev_certs(
    directory: Path, subject_list: list[Subject], *, days: int = 365, force: bool = False
) -> list[Path]:
    """Writes ca.crt, ca.key and one <id>.crt/.key per subject; returns the files written."""
    if not 1 <= days <= DAYS_MAX:
        raise CertsError(f"--days must be from 1 to {DAYS_MAX}, not {days}")
    planned = [directory / f"{CA_NAME}.crt", directory / f"{CA_NAME}.key"]
    for subject in subject_list:
        planned.extend(identity_paths(directory, subject.identity))
    existing = [path for path in planned if path.exists()]
    if existing and not force:
        shown = ", ".join(str(path) for path in existing[:3])
        more = f" and {len(existing) - 3} more" if len(existing) > 3 else ""
        raise CertsError(f"{shown}{more} already exist; use --force to replace them")
    if directory.exists() and not directory.is_dir():
        raise CertsError(f"{directory} exists and is not a directory")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)  # it holds private keys

    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(minutes=5)  # tolerate small clock differences
    end = now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Squall development CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    written = [directory / f"{CA_NAME}.crt", directory / f"{CA_NAME}.key"]
    written[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_private(written[1], _key_pem(ca_key))
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    for subject in subject_list:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject.identity)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_alt_names(subject)), critical=False)
            .add_extension(
                # Each service is a server to its callers and a client of its peers.
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), False
            )
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = identity_paths(directory, subject.identity)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_private(key_path, _key_pem(key))
        written.extend([cert_path, key_path])
    return written
