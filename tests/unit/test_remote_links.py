"""Links between clusters, the parts that need no second cluster: the [[remotes]] entries
of the cluster file and what an app hears when the remote cluster refuses (issue 19
items 2 and 6).

Goal: a remote is configured with a clear error naming the field for each mistake, and a
remote that is unreachable, presents the wrong TLS identity or refuses the token is
reported naming the remote and the cause.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from squall_server.common.config import RemoteConfig
from squall_server.common.errors import Code
from squall_server.replica.remote import remote_error
from tests.unit.test_config import VALID, error_of, parse

REMOTE = '\n[[remotes]]\nname = "site-b"\ngateways = ["10.0.0.5:7100", "10.0.0.6:7100"]\n'


def test_a_remote_is_read_with_paths_against_the_file() -> None:
    config = parse(VALID + REMOTE + 'ca_file = "b-ca.crt"\ntoken_file = "/run/b.token"\n')
    remote = config.remote("site-b")
    assert remote is not None and config.remote("other") is None
    assert remote.gateways == ("10.0.0.5:7100", "10.0.0.6:7100")
    assert remote.ca_file == Path("/etc/squall/b-ca.crt")
    assert remote.token_file == Path("/run/b.token")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (REMOTE.replace('"site-b"', '"test"'), "is this cluster's own name"),
        (REMOTE + REMOTE, "is listed twice"),
        (REMOTE.replace('"10.0.0.5:7100", ', '"10.0.0.5", '), "remotes[0].gateways"),
        (REMOTE.replace('["10.0.0.5:7100", "10.0.0.6:7100"]', "[]"), "non-empty list"),
        ('\n[[remotes]]\nname = "x"\n', "remotes[0].gateways: required key is missing"),
        (REMOTE + 'token = "secret"\n', "unknown key 'token'"),
    ],
)
def test_remote_mistakes_are_named(text: str, words: str) -> None:
    assert words in error_of(VALID + text)


def _remote(**kw: object) -> RemoteConfig:
    args: dict[str, object] = {"name": "site-b", "gateways": ("10.0.0.5:7100",)}
    args.update(kw)
    return RemoteConfig(**args)  # type: ignore[arg-type]


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_a_refused_token_names_the_token_file() -> None:
    error = remote_error(
        _remote(token_file=Path("/run/b.token")),
        _rpc_error(grpc.StatusCode.UNAUTHENTICATED, "invalid token"),
        "find topic 'orders'",
    )
    assert error.code == Code.FAILED_PRECONDITION
    assert "remote cluster 'site-b' at 10.0.0.5:7100 refused find topic 'orders'" in error.message
    assert "the token in /run/b.token was refused" in error.message
    missing = remote_error(
        _remote(), _rpc_error(grpc.StatusCode.UNAUTHENTICATED, "no token"), "find topic 'x'"
    )
    assert "no token is configured (remotes.token_file)" in missing.message


def test_a_wrong_tls_identity_names_what_was_expected() -> None:
    error = remote_error(
        _remote(ca_file=Path("/etc/squall/b-ca.crt"), server_name="gw.site-b"),
        _rpc_error(grpc.StatusCode.UNAVAILABLE, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED"),
        "find topic 'orders'",
    )
    assert error.code == Code.FAILED_PRECONDITION
    assert "TLS handshake failed" in error.message
    assert "a certificate for gw.site-b from the CA in /etc/squall/b-ca.crt" in error.message


def test_an_unreachable_remote_and_a_missing_topic() -> None:
    down = remote_error(
        _remote(), _rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"), "find topic 'o'"
    )
    assert down.code == Code.FAILED_PRECONDITION
    assert "could not find topic 'o' (UNAVAILABLE: connection refused)" in down.message
    missing = remote_error(
        _remote(), _rpc_error(grpc.StatusCode.NOT_FOUND, "topic 'o' does not exist"), "find"
    )
    assert missing.code == Code.NOT_FOUND and "site-b" in missing.message
