"""[tls] in the configuration file, the start-up check of a service's own certificate, and
`squall certs dev`.

Each error test asserts what an operator reads: the key, the file, and what is wrong.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from cryptography import x509

import squall
from squall_server import cli
from squall_server.common import dev_certs
from squall_server.common.config import (
    ConfigError,
    check_tls_identity,
    load_config,
    load_config_or_exit,
    parse_config,
)
from tests.unit.test_config import VALID


def _with_tls(tmp_path: Path, tls: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(VALID + "\n[tls]\n" + tls)
    return path


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """Development certificates for VALID's nodes and gateway, plus an `app` client."""
    config = parse_config(VALID, tmp_path / "cluster.toml")
    directory = tmp_path / "certs"
    dev_certs.make_dev_certs(directory, dev_certs.subjects(config, ["app"]))
    return directory


def test_tls_is_off_by_default() -> None:
    config = parse_config(VALID, "cluster.toml")
    assert config.tls.enabled is False


def test_relative_tls_paths_resolve_against_the_config_directory(tmp_path: Path) -> None:
    path = _with_tls(tmp_path, 'enabled = true\nca_file = "certs/ca.crt"\ncert_dir = "certs"\n')
    config = load_config(path)  # the files are checked by the service using them, later
    assert config.tls.ca_file == (tmp_path / "certs" / "ca.crt").resolve()
    assert config.tls.cert_dir == (tmp_path / "certs").resolve()


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ('enabled = true\ncert_dir = "c"\n', "tls.ca_file: required key is missing"),
        ('enabled = true\nca_file = "c/ca.crt"\n', "tls.cert_dir: required key is missing"),
        ('enabled = "yes"\n', "tls.enabled: must be true or false, got 'yes'"),
        ("enabeld = true\n", "unknown key 'enabeld' in [tls]; did you mean 'enabled'?"),
        ('enabled = true\nca_file = 3\ncert_dir = "c"\n', "tls.ca_file: must be a string"),
        (
            'enabled = true\nca_file = "c/ca.crt"\ncert_dir = "c"\npush = "off"\n',
            "tls.push: must be one of 'tls', 'plaintext', got 'off'",
        ),
        ('push_ca_file = "c/ca.crt"\n', "tls.push_ca_file: set, but tls.enabled is false"),
    ],
)
def test_a_bad_tls_section_is_named(tmp_path: Path, tls: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(_with_tls(tmp_path, tls))
    assert message in str(error.value)


def test_push_deliveries_use_tls_once_tls_is_on_unless_told_plaintext(tmp_path: Path) -> None:
    on = 'enabled = true\nca_file = "c/ca.crt"\ncert_dir = "c"\n'
    assert load_config(_with_tls(tmp_path, on)).tls.push_tls
    assert not load_config(_with_tls(tmp_path, on + 'push = "plaintext"\n')).tls.push_tls
    assert not parse_config(VALID, "cluster.toml").tls.push_tls


def test_a_service_checks_the_push_ca_file_at_start_up(tmp_path: Path, certs: Path) -> None:
    path = _with_tls(
        tmp_path,
        f'enabled = true\nca_file = "{certs / "ca.crt"}"\ncert_dir = "{certs}"\n'
        f'push_ca_file = "{certs / "app.key"}"\n',
    )
    with pytest.raises(ConfigError) as error:
        check_tls_identity(load_config(path).tls, "n1")
    assert f"tls.push_ca_file: {certs / 'app.key'} is not a PEM certificate file" in str(
        error.value
    )


def test_a_tls_push_endpoint_needs_a_certificate_and_key(certs: Path) -> None:
    with pytest.raises(ValueError, match="a PushEndpoint with TLS needs cert_file and key_file"):
        squall.PushEndpoint(tls=squall.TlsOptions(ca_file=certs / "ca.crt"))
    with pytest.raises(ValueError, match=r"TlsOptions\.cert_file: .* is not PEM"):
        squall.PushEndpoint(
            tls=squall.TlsOptions(
                ca_file=certs / "ca.crt", cert_file=certs / "app.key", key_file=certs / "app.key"
            )
        )


def _tls_config(tmp_path: Path, certs: Path) -> Path:
    return _with_tls(
        tmp_path, f'enabled = true\nca_file = "{certs / "ca.crt"}"\ncert_dir = "{certs}"\n'
    )


def test_a_service_with_good_certificates_starts(tmp_path: Path, certs: Path) -> None:
    config = load_config_or_exit(_tls_config(tmp_path, certs), node_id="n2")
    assert config.tls.enabled


def _identity_error(tmp_path: Path, certs: Path, identity: str = "n1") -> str:
    config = load_config(_tls_config(tmp_path, certs))
    with pytest.raises(ConfigError) as error:
        check_tls_identity(config.tls, identity)
    return str(error.value)


def test_a_missing_certificate_is_named(tmp_path: Path, certs: Path) -> None:
    (certs / "n1.crt").unlink()
    assert _identity_error(tmp_path, certs) == f"tls.cert_dir: {certs / 'n1.crt'} does not exist"


def test_a_missing_ca_file_is_named(tmp_path: Path, certs: Path) -> None:
    (certs / "ca.crt").unlink()
    assert _identity_error(tmp_path, certs) == f"tls.ca_file: {certs / 'ca.crt'} does not exist"


def test_a_file_that_is_not_pem_is_named(tmp_path: Path, certs: Path) -> None:
    (certs / "n1.crt").write_text("hello\n")
    assert "n1.crt is not a PEM certificate file" in _identity_error(tmp_path, certs)
    (certs / "ca.crt").write_bytes(b"\x00\x01")
    assert "tls.ca_file:" in _identity_error(tmp_path, certs)


def test_an_unreadable_key_is_named(tmp_path: Path, certs: Path) -> None:
    if os.geteuid() == 0:
        # root reads any file; a directory in the key's place is unreadable as a file.
        (certs / "n1.key").unlink()
        (certs / "n1.key").mkdir()
        assert "n1.key is a directory, not a file" in _identity_error(tmp_path, certs)
    else:
        (certs / "n1.key").chmod(0)
        assert "cannot read" in _identity_error(tmp_path, certs)


def test_a_key_that_does_not_match_its_certificate_is_named(tmp_path: Path, certs: Path) -> None:
    shutil.copy(certs / "n2.key", certs / "n1.key")
    message = _identity_error(tmp_path, certs)
    assert f"the key {certs / 'n1.key'} does not match the certificate {certs / 'n1.crt'}" in (
        message
    )


def test_another_nodes_certificate_is_named(tmp_path: Path, certs: Path) -> None:
    shutil.copy(certs / "n2.crt", certs / "n1.crt")
    shutil.copy(certs / "n2.key", certs / "n1.key")
    message = _identity_error(tmp_path, certs)
    assert "names 127.0.0.1" not in message  # IP names are not DNS names
    assert "names localhost, n2, not 'n1'" in message


def test_a_certificate_from_another_ca_is_named(tmp_path: Path, certs: Path) -> None:
    other = tmp_path / "other"
    dev_certs.make_dev_certs(other, [dev_certs.Subject("n1")])
    shutil.copy(other / "n1.crt", certs / "n1.crt")
    shutil.copy(other / "n1.key", certs / "n1.key")
    assert "is not signed by the CA in tls.ca_file" in _identity_error(tmp_path, certs)


def test_a_bad_certificate_stops_the_service_with_status_2(
    tmp_path: Path, certs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (certs / "g1.key").unlink()
    with pytest.raises(SystemExit) as exited:
        load_config_or_exit(_tls_config(tmp_path, certs), gateway_id="g1")
    assert exited.value.code == 2
    assert f"tls.cert_dir: {certs / 'g1.key'} does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------- certs dev


def test_dev_certificates_name_their_member_and_its_hosts(certs: Path) -> None:
    cert = x509.load_pem_x509_certificate((certs / "n2.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"n2", "localhost"}
    assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert {p.name for p in certs.iterdir()} == {
        f"{name}.{ext}"
        for name in ("ca", "n1", "n2", "n3", "g1", "admin", "app")
        for ext in ("crt", "key")
    }


def test_dev_keys_are_private(certs: Path) -> None:
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    for key in certs.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_certs_dev_refuses_to_overwrite_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text(VALID)
    out = tmp_path / "certs"
    assert cli.main(["certs", "dev", str(out), "--config", str(config)]) == 0
    assert "certificates for n1, n2, n3, g1, admin" in capsys.readouterr().out
    before = (out / "n1.crt").read_bytes()
    assert cli.main(["certs", "dev", str(out), "--config", str(config)]) == 1
    assert "already exist; use --force to replace them" in capsys.readouterr().err
    assert (out / "n1.crt").read_bytes() == before
    assert cli.main(["certs", "dev", str(out), "--config", str(config), "--force"]) == 0
    assert (out / "n1.crt").read_bytes() != before


def test_a_client_certificate_may_not_carry_a_members_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text(VALID)
    assert (
        cli.main(["certs", "dev", str(tmp_path / "c"), "--config", str(config), "--client", "n2"])
        == 1
    )
    assert "'n2' is already a node or gateway id" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_client_certificate_names_the_hosts_its_push_endpoint_serves_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "certs"
    assert cli.main(["certs", "dev", str(out), "--client", "billing@10.0.0.7,app.example.net"]) == 0
    assert "certificates for admin, billing" in capsys.readouterr().out
    cert = x509.load_pem_x509_certificate((out / "billing.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {
        "billing",
        "localhost",
        "app.example.net",
    }
    ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert {"10.0.0.7", "127.0.0.1"} <= ips
    assert cli.main(["certs", "dev", str(tmp_path / "bad"), "--client", "billing@no host"]) == 1
    assert "--client billing@no host: 'no host' is not a host name or IP address" in (
        capsys.readouterr().err
    )


# --------------------------------------------------------------------------- library


def test_tls_options_name_a_file_they_cannot_use(tmp_path: Path, certs: Path) -> None:
    with pytest.raises(ValueError, match=r"TlsOptions.ca_file: cannot read .*missing.crt"):
        squall.connect("127.0.0.1:1", tls=squall.TlsOptions(ca_file=tmp_path / "missing.crt"))
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        squall.TlsOptions(ca_file=certs / "ca.crt", cert_file=certs / "app.crt").credentials()
    with pytest.raises(ValueError, match=r"TlsOptions.key_file: .*app.crt is not PEM"):
        squall.TlsOptions(
            ca_file=certs / "ca.crt", cert_file=certs / "app.crt", key_file=certs / "app.crt"
        ).credentials()
