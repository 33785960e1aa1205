"""Reading and checking the PEM files of [tls]: the cluster CA and one identity's cert and key.

A service checks its own certificate before it starts, so a wrong file is one line naming
the key and the file (missing, unreadable, not PEM, key not matching, not from the CA,
not naming this id) instead of a handshake failure on every peer minutes later. Kept free
of grpc so config validation and `squall certs` share it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# cryptography takes a noticeable share of a second to import: only processes with TLS on
# (or `squall certs`) pay for it, inside the functions that need it.
if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

# A CA bundle or certificate larger than this is not one (bound what we read).
PEM_FILE_BYTES_MAX = 1024 * 1024


class TlsFileError(ValueError):
    """A [tls] file that cannot be used; str() names the key and the file."""


@dataclass(frozen=True)
class IdentityFiles:
    """One identity's PEM bytes, checked: certificate, key, and the CA they chain to."""

    identity: str
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    cert_path: Path
    key_path: Path


def identity_paths(cert_dir: Path, identity: str) -> tuple[Path, Path]:
    """Where cert_dir keeps identity's certificate and private key."""
    return cert_dir / f"{identity}.crt", cert_dir / f"{identity}.key"


def _read(path: Path, field_name: str) -> bytes:
    """The bytes of a file a [tls] key names, or TlsFileError saying why not."""
    try:
        size = path.stat().st_size
        if size > PEM_FILE_BYTES_MAX:
            raise TlsFileError(
                f"{field_name}: {path} is {size} bytes, more than a PEM file "
                f"({PEM_FILE_BYTES_MAX} bytes at most)"
            )
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsFileError(f"{field_name}: {path} does not exist") from None
    except IsADirectoryError:
        raise TlsFileError(f"{field_name}: {path} is a directory, not a file") from None
    except OSError as error:
        raise TlsFileError(
            f"{field_name}: cannot read {path}: {error.strerror or type(error).__name__}"
        ) from None


def _certificates(data: bytes, path: Path, field_name: str) -> list[x509.Certificate]:
    """Every certificate of a PEM file (at least one)."""
    from cryptography import x509

    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise TlsFileError(f"{field_name}: {path} is not a PEM certificate file")
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as error:
        raise TlsFileError(f"{field_name}: {path} holds a malformed certificate: {error}") from None


def read_ca(path: Path, field_name: str = "tls.ca_file") -> tuple[bytes, list[x509.Certificate]]:
    """The CA file's bytes and certificates (field_name: the [tls] key naming the file)."""
    data = _read(path, field_name)
    return data, _certificates(data, path, field_name)


def check_dir(path: Path) -> None:
    """cert_dir is an existing directory."""
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise TlsFileError(f"tls.cert_dir: {path} {what}")


def certificate_names(cert: x509.Certificate) -> frozenset[str]:
    """The DNS names of a certificate's subject alternative names."""
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    return frozenset(san.get_values_for_type(x509.DNSName))


def _load_key(data: bytes, path: Path) -> PrivateKeyTypes:
    from cryptography.hazmat.primitives import serialization

    if b"PRIVATE KEY-----" not in data:
        raise TlsFileError(f"tls.cert_dir: {path} is not a PEM private key")
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as error:
        # TypeError: the key is encrypted; the services cannot ask for a passphrase.
        raise TlsFileError(
            f"tls.cert_dir: {path} is not a usable unencrypted PEM private key: {error}"
        ) from None


def _public_bytes(key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    public = key.public_key()  # type: ignore[attr-defined]
    data: bytes = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return data


def load_identity(ca_file: Path, cert_dir: Path, identity: str) -> IdentityFiles:
    """identity's certificate and key from cert_dir, checked against each other and the CA."""
    ca_pem, authorities = read_ca(ca_file)
    cert_path, key_path = identity_paths(cert_dir, identity)
    cert_pem = _read(cert_path, "tls.cert_dir")
    cert = _certificates(cert_pem, cert_path, "tls.cert_dir")[0]
    key_pem = _read(key_path, "tls.cert_dir")
    key = _load_key(key_pem, key_path)
    if _public_bytes(key) != _public_bytes(cert):
        raise TlsFileError(
            f"tls.cert_dir: the key {key_path} does not match the certificate {cert_path}"
        )
    if not any(_issued_by(cert, authority) for authority in authorities):
        raise TlsFileError(
            f"tls.cert_dir: the certificate {cert_path} is not signed by the CA in "
            f"tls.ca_file ({ca_file})"
        )
    names = certificate_names(cert)
    if identity not in names:
        shown = ", ".join(sorted(names)) or "no DNS names"
        raise TlsFileError(
            f"tls.cert_dir: the certificate {cert_path} names {shown}, not {identity!r}; "
            "peers would refuse it"
        )
    return IdentityFiles(identity, ca_pem, cert_pem, key_pem, cert_path, key_path)


def _issued_by(cert: x509.Certificate, authority: x509.Certificate) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def write_private(path: Path, data: bytes) -> None:
    """Writes a file only its owner can read (created 0600, never briefly wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)
