"""Client authentication: the [auth] section, the permission decision, tokens, the guards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import pytest

from squall.v1 import broker_pb2, common_pb2
from squall.wire.auth import check_token, resolve_token
from squall_server.common.auth import (
    METHOD_RULES,
    TokenBook,
    Verdict,
    bearer_token,
    decide,
    decide_publish_into,
    decide_publisher_id,
    token_sha256,
)
from squall_server.common.auth_config import PrincipalConfig
from squall_server.common.call_guard import (
    CLIENT_PEER_KEY,
    AuthGuard,
    Call,
    ClientLimitsGuard,
    Refusal,
    Request,
)
from squall_server.common.config import ConfigError, LimitsConfig, parse_config

BASE = """
[cluster]
name = "c"
[[nodes]]
id = "n1"
priority = 1
coordinator_address = "127.0.0.1:7101"
replica_address = "127.0.0.1:7201"
data_dir = "d1"
[[gateways]]
id = "g1"
address = "127.0.0.1:7100"
"""

HASH_A = token_sha256("token-a")
HASH_B = token_sha256("token-b")

PUBLISHER = PrincipalConfig("orders-app", HASH_A, publish=("orders.*",), subscribe=())
READER = PrincipalConfig("reader", HASH_B, subscribe=("orders.*", "audit"))
ADMIN = PrincipalConfig("ops", token_sha256("token-ops"), admin=True)

PUBLISH = "/squall.v1.Publisher/Publish"
SUBSCRIBE = "/squall.v1.Subscriber/Subscribe"
CREATE = "/squall.v1.TopicManager/CreateTopic"
LIST = "/squall.v1.TopicManager/ListTopics"
RETRIEVE = "/squall.v1.TopicManager/RetrieveTopic"
STREAM = "/squall.v1.Publisher/PublishStream"


# [auth] needs [tls]; only the paths are read when the file is parsed.
TLS = '[tls]\nenabled = true\nca_file = "certs/ca.crt"\ncert_dir = "certs"\n'


def _config(auth: str) -> object:
    return parse_config(BASE + TLS + auth, "/tmp/c.toml")


def test_auth_without_tls_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"auth\.enabled: requires tls\.enabled = true"):
        parse_config(BASE + "[auth]\nenabled = true\n" + _principal(), "/tmp/c.toml")


# --- the decision (pure)


# The methods an app or operator may call; everything else is cluster-internal.
_INTERNAL_METHODS = {"/squall.v1.Coordinator/Deliver"}


def test_every_public_and_operator_method_has_a_rule() -> None:
    # A method without a rule passes the guard untouched, so a new RPC that nobody added
    # here would skip the token check: found once for the shared-subscription calls.
    from squall.v1 import broker_pb2, coordinator_pb2, gateway_pb2

    methods = {
        f"/{service.full_name}/{method.name}"
        for module in (broker_pb2, gateway_pb2, coordinator_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    unguarded = sorted(methods - set(METHOD_RULES) - _INTERNAL_METHODS)
    assert not unguarded, f"methods with no auth rule: {unguarded}"


def test_no_principal_is_unauthenticated_whatever_the_method() -> None:
    for method in METHOD_RULES:
        decision = decide(method, "orders.eu", None, None)
        assert decision.verdict is Verdict.UNAUTHENTICATED
        assert "missing or unknown token" in decision.message


def test_publish_is_allowed_only_on_matching_topics() -> None:
    assert decide(PUBLISH, "orders.eu", PUBLISHER, None).allowed
    denied = decide(PUBLISH, "payroll", PUBLISHER, None)
    assert denied.verdict is Verdict.PERMISSION_DENIED
    assert denied.message == "principal 'orders-app' may not publish to topic 'payroll'"
    # The denial names the topic asked for and nothing the principal may use.
    assert "orders" not in denied.message.replace("orders-app", "")


def test_a_subscribe_only_principal_cannot_publish_and_vice_versa() -> None:
    assert decide(SUBSCRIBE, "audit", READER, None).allowed
    assert decide(PUBLISH, "audit", READER, None).verdict is Verdict.PERMISSION_DENIED
    assert decide(SUBSCRIBE, "orders.eu", PUBLISHER, None).verdict is Verdict.PERMISSION_DENIED


def test_admin_methods_need_admin() -> None:
    for method in (
        CREATE,
        "/squall.v1.Coordinator/SetQuarantine",
        "/squall.v1.Coordinator/ChangeMembership",
        "/squall.v1.ClusterAdmin/GetClusterStatus",
    ):
        denied = decide(method, "orders.eu", PUBLISHER, None)
        assert denied.verdict is Verdict.PERMISSION_DENIED
        assert "(admin only)" in denied.message
        assert decide(method, "orders.eu", ADMIN, None).allowed


def test_lookup_needs_publish_or_subscribe_and_list_needs_only_a_principal() -> None:
    assert decide(RETRIEVE, "orders.eu", PUBLISHER, None).allowed
    assert decide(RETRIEVE, "audit", READER, None).allowed
    assert decide(RETRIEVE, "audit", PUBLISHER, None).verdict is Verdict.PERMISSION_DENIED
    assert decide(LIST, "", READER, None).allowed


def test_a_cluster_member_certificate_is_trusted_without_a_token() -> None:
    assert decide(CREATE, "x", None, "g1").allowed
    assert decide(PUBLISH, "x", None, "n2").allowed


def test_globs_are_fnmatch_and_case_sensitive() -> None:
    principal = PrincipalConfig("p", HASH_A, publish=("log-[ab]?", "*.raw"))
    assert decide(PUBLISH, "log-a1", principal, None).allowed
    assert decide(PUBLISH, "x.y.raw", principal, None).allowed
    assert not decide(PUBLISH, "log-c1", principal, None).allowed
    assert not decide(PUBLISH, "X.RAW", principal, None).allowed


# --- tokens


def test_the_token_book_finds_principals_by_token_hash() -> None:
    book = TokenBook([PUBLISHER, READER])
    assert book.principal("token-a") is PUBLISHER
    assert book.principal("token-b") is READER
    assert book.principal("token-c") is None
    assert book.principal("") is None
    assert book.principal(None) is None


def test_bearer_token_is_read_from_the_authorization_metadata() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("authorization", "bearer abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("x", "Bearer abc")]) is None
    assert bearer_token(None) is None


def test_client_token_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv("SQUALL_TOKEN", raising=False)
    monkeypatch.delenv("SQUALL_TOKEN_FILE", raising=False)
    assert resolve_token() is None
    path = tmp_path / "token"
    path.write_text("from-file\n")
    monkeypatch.setenv("SQUALL_TOKEN_FILE", str(path))
    assert resolve_token() == "from-file"
    monkeypatch.setenv("SQUALL_TOKEN", "from-env")
    assert resolve_token() == "from-env"
    assert resolve_token("explicit") == "explicit"
    with pytest.raises(ValueError, match="space") as error:
        check_token("two words", "the token argument")
    assert "two words" not in str(error.value)
    monkeypatch.delenv("SQUALL_TOKEN")
    monkeypatch.setenv("SQUALL_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the token file"):
        resolve_token()


# --- the [auth] section


def _principal(**fields: str) -> str:
    values = {"name": '"app"', "token_sha256": f'"{HASH_A}"', **fields}
    return "[[auth.principals]]\n" + "\n".join(f"{k} = {v}" for k, v in values.items()) + "\n"


def test_a_valid_auth_section_is_read() -> None:
    config = _config(
        "[auth]\nenabled = true\n"
        + _principal(publish='["orders.*"]', subscribe='["a", "b?"]')
        + _principal(name='"ops"', token_sha256=f'"{HASH_B}"', admin="true", link_from='["s*"]')
    )
    auth = config.auth  # type: ignore[attr-defined]
    assert auth.enabled
    assert auth.principals[0] == PrincipalConfig("app", HASH_A, ("orders.*",), ("a", "b?"), False)
    assert auth.principals[1].admin and auth.principals[1].link_from == ("s*",)


def test_auth_is_off_by_default() -> None:
    assert not _config("").auth.enabled  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (_principal(publish='["orders.[ab"]'), r"auth.principals\[0\].publish\[0\]: .*unclosed"),
        (_principal(subscribe='["a b"]'), r"auth.principals\[0\].subscribe\[0\]: .*not a topic"),
        (_principal(publish='"orders"'), r"auth.principals\[0\].publish: must be an array"),
        (
            _principal() + _principal(token_sha256=f'"{HASH_B}"'),
            r"auth.principals\[1\].name: 'app' is already the name of auth.principals\[0\]",
        ),
        (
            _principal() + _principal(name='"b"'),
            r"auth.principals\[1\].token_sha256: the same token hash",
        ),
        (_principal(token_sha256='"abc"'), r"auth.principals\[0\].token_sha256: must be 64"),
        (_principal(token_sha256=f'"{HASH_A.upper()}"'), r"token_sha256: must be 64 lowercase"),
        (_principal(admin='"yes"'), r"auth.principals\[0\].admin: must be true or false"),
        (_principal(link_from='"site-a"'), r"auth.principals\[0\].link_from: must be an array"),
        (_principal(link_from='["a b"]'), r"auth.principals\[0\].link_from\[0\]: .*not a"),
        (_principal(name='"-x"'), r"auth.principals\[0\].name: principal names"),
        (_principal(token='"t"'), r"unknown key 'token' in auth.principals\[0\]"),
        ("[auth]\nenabled = true\n", r"auth.enabled: is true but no \[\[auth.principals\]\]"),
        ("[auth]\nenabled = 1\n" + _principal(), r"auth.enabled: must be true or false"),
        ("[auth]\nenable = true\n", r"unknown key 'enable' in \[auth\]"),
    ],
)
def test_bad_auth_sections_are_refused_naming_the_key(section: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as error:
        _config(section)
    assert "token-a" not in str(error.value)


def test_new_limit_keys_are_validated() -> None:
    for key, bad in (
        ("client_streams_max", 0),
        ("client_inflight_publishes_max", 0),
        ("metadata_bytes_max", 100),
        ("topic_subscriptions_max", 0),
    ):
        with pytest.raises(ConfigError, match=f"limits.{key}: must be from"):
            _config(f"[limits]\n{key} = {bad}\n")


# --- the guards, with a stand-in for the servicer context


class _Context:
    def __init__(
        self, metadata: Sequence[tuple[str, str]] = (), peer: str = "ipv4:1.2.3.4:5"
    ) -> None:
        self._metadata = tuple(metadata)
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> Mapping[str, Sequence[bytes]]:
        return {}


def _call(
    method: str,
    metadata: Sequence[tuple[str, str]] = (),
    *,
    streaming: bool = False,
    peer: str = "ipv4:1.2.3.4:5",
) -> Call:
    context: Any = _Context(metadata, peer)
    return Call(method, context, streaming=streaming, member=None)


def _auth_guard() -> AuthGuard:
    from squall_server.common.auth_config import AuthConfig

    return AuthGuard(AuthConfig(enabled=True, principals=(PUBLISHER, READER)))


def test_the_auth_guard_refuses_before_reading_when_there_is_no_token() -> None:
    with pytest.raises(Refusal) as refused:
        _auth_guard().open(_call(PUBLISH))
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(Refusal) as refused:
        _auth_guard().open(_call(PUBLISH, [("authorization", "Bearer nope")]))
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_auth_guard_checks_each_request_topic_from_bytes_or_messages() -> None:
    session = _auth_guard().open(_call(PUBLISH, [("authorization", "Bearer token-a")]))
    assert session is not None
    session.request(Request(PUBLISH, broker_pb2.PublishRequest(topic="orders.eu")))
    raw = broker_pb2.PublishRequest(topic="payroll").SerializeToString()
    with pytest.raises(Refusal) as refused:
        session.request(Request(PUBLISH, raw))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "payroll" in refused.value.message


def test_the_auth_guard_checks_every_part_of_a_joined_publish() -> None:
    """A joined publish (PublishRequest.parts) is as many publishes: each part's topic and
    publisher id is checked, not only the envelope's."""
    session = _auth_guard().open(_call(STREAM, [("authorization", "Bearer token-a")]))
    assert session is not None
    joined = broker_pb2.PublishRequest(
        topic="orders.eu",
        parts=[
            broker_pb2.PublishRequest(topic="orders.eu", publisher_id="a"),
            broker_pb2.PublishRequest(topic="orders.us", publisher_id="b"),
        ],
    )
    session.request(Request(STREAM, joined))
    joined.parts.add(topic="payroll", publisher_id="c")
    with pytest.raises(Refusal) as refused:
        session.request(Request(STREAM, joined.SerializeToString()))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "payroll" in refused.value.message
    del joined.parts[2]
    joined.parts.add(topic="orders.eu", publisher_id="squall-link/site-a/7")
    with pytest.raises(Refusal, match="reserved for topic links"):
        session.request(Request(STREAM, joined))


def test_dead_letters_go_only_where_the_subscriptions_creator_may_publish() -> None:
    create = "/squall.v1.Subscriber/CreateSharedSubscription"
    session = _auth_guard().open(_call(create, [("authorization", "Bearer token-b")]))
    assert session is not None
    # The reader may subscribe to orders.*, but publish nowhere.
    session.request(Request(create, broker_pb2.CreateSharedSubscriptionRequest(topic="audit")))
    request = broker_pb2.CreateSharedSubscriptionRequest(
        topic="orders.eu", dead_letter_topic="orders.dead"
    )
    with pytest.raises(Refusal) as refused:
        session.request(Request(create, request.SerializeToString()))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.message == (
        "principal 'reader' may not send dead letters to topic 'orders.dead'"
    )
    both = PrincipalConfig("worker", HASH_A, publish=("orders.dead",), subscribe=("orders.*",))
    assert decide_publish_into(create, "orders.dead", both, None).allowed
    assert decide_publish_into(create, "orders.dead", ADMIN, None).allowed


def test_link_publisher_ids_are_reserved_for_the_principal_carrying_that_clusters_links() -> None:
    from squall_server.common import auth
    from squall_server.replica import link_rules

    assert auth.LINK_PUBLISHER_PREFIX == link_rules.LINK_PUBLISHER_PREFIX
    site_a = link_rules.link_publisher_id(7, "site-a")
    link = PrincipalConfig("site-a-link", HASH_B, publish=("orders.*",), link_from=("site-a",))
    guard = AuthGuard(_auth_config(PUBLISHER, link))
    # An app allowed to publish on the topic may not pose as site-a's link...
    session = guard.open(_call(PUBLISH, [("authorization", "Bearer token-a")]))
    assert session is not None
    session.request(Request(PUBLISH, broker_pb2.PublishRequest(topic="orders.eu")))
    session.request(
        Request(PUBLISH, broker_pb2.PublishRequest(topic="orders.eu", publisher_id="squall-linker"))
    )
    forged = broker_pb2.PublishRequest(topic="orders.eu", publisher_id=site_a)
    with pytest.raises(Refusal) as refused:
        session.request(Request(PUBLISH, forged.SerializeToString()))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.message == (
        f"principal 'orders-app' may not publish under publisher id '{site_a}': the prefix "
        "'squall-link/' is reserved for topic links (a principal needs link_from matching "
        "'site-a' to carry that cluster's links)"
    )
    # ...on a stream either; the link's own principal may, for site-a only.
    stream = guard.open(_call(STREAM, [("authorization", "Bearer token-b")], streaming=True))
    assert stream is not None
    stream.request(Request(STREAM, forged))
    other = broker_pb2.PublishRequest(topic="orders.eu", publisher_id="squall-link/site-c/7")
    with pytest.raises(Refusal, match="link_from matching 'site-c'"):
        stream.request(Request(STREAM, other))
    # This cluster's own link ids: nobody (its replicas write them through the log).
    assert not decide_publisher_id("squall-link/7", link, None).allowed
    assert "write those themselves" in decide_publisher_id("squall-link/7", link, None).message
    assert not decide_publisher_id("squall-link/site-a/7", ADMIN, None).allowed
    # A cluster member (a gateway forwarding a call it already checked) is trusted.
    assert decide_publisher_id(site_a, None, "g1").allowed
    wildcard = PrincipalConfig("hub", HASH_A, link_from=("site-*",))
    assert decide_publisher_id("squall-link/site-zz/1", wildcard, None).allowed
    assert not decide_publisher_id("squall-link/other/1", wildcard, None).allowed


def _auth_config(*principals: PrincipalConfig) -> Any:
    from squall_server.common.auth_config import AuthConfig

    return AuthConfig(enabled=True, principals=principals)


def test_list_topics_answers_only_visible_topics() -> None:
    session = _auth_guard().open(_call(LIST, [("authorization", "Bearer token-b")]))
    assert session is not None
    listed = broker_pb2.ListTopicsResponse(
        topics=[common_pb2.Topic(name=n) for n in ("audit", "orders.eu", "payroll")]
    )
    filtered = session.response(listed)
    assert [t.name for t in filtered.topics] == ["audit", "orders.eu"]
    as_bytes = broker_pb2.ListTopicsResponse.FromString(
        session.response(listed.SerializeToString())
    )
    assert [t.name for t in as_bytes.topics] == ["audit", "orders.eu"]


def test_streams_per_client_are_bounded_and_released() -> None:
    guard = ClientLimitsGuard(LimitsConfig(client_streams_max=2), auth_enabled=False)
    sessions = [guard.open(_call(SUBSCRIBE, streaming=True)) for _ in range(2)]
    with pytest.raises(Refusal) as refused:
        guard.open(_call(SUBSCRIBE, streaming=True))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.client_streams_max is 2" in refused.value.message
    # Another client is not affected; a closed stream frees its place.
    guard.open(_call(SUBSCRIBE, streaming=True, peer="ipv4:1.2.3.4:6"))
    sessions[0].close()  # type: ignore[union-attr]
    guard.open(_call(SUBSCRIBE, streaming=True))


def test_a_forwarded_client_is_counted_as_itself_only_when_the_marker_is_trusted() -> None:
    limits = LimitsConfig(client_streams_max=1)
    forwarded = [(CLIENT_PEER_KEY, "ipv4:9.9.9.9:1")]
    open_guard = ClientLimitsGuard(limits, auth_enabled=False)
    open_guard.open(_call(SUBSCRIBE, forwarded, streaming=True, peer="ipv4:gw:1"))
    open_guard.open(
        _call(SUBSCRIBE, [(CLIENT_PEER_KEY, "ipv4:9.9.9.9:2")], streaming=True, peer="ipv4:gw:1")
    )
    # With auth on and no member certificate, the marker could be forged: the connection counts.
    strict = ClientLimitsGuard(limits, auth_enabled=True)
    strict.open(_call(SUBSCRIBE, forwarded, streaming=True, peer="ipv4:gw:1"))
    with pytest.raises(Refusal):
        strict.open(
            _call(SUBSCRIBE, [(CLIENT_PEER_KEY, "other")], streaming=True, peer="ipv4:gw:1")
        )


def test_inflight_publishes_per_client_are_bounded() -> None:
    guard = ClientLimitsGuard(LimitsConfig(client_inflight_publishes_max=2), auth_enabled=False)
    stream = guard.open(_call("/squall.v1.Publisher/PublishStream", streaming=True))
    assert stream is not None
    request = Request(PUBLISH, broker_pb2.PublishRequest(topic="t"))
    stream.request(request)
    stream.request(request)
    with pytest.raises(Refusal) as refused:
        guard.open(_call(PUBLISH))
    assert "limits.client_inflight_publishes_max is 2" in refused.value.message
    stream.response(broker_pb2.PublishResponse())  # one receipt back: one place free
    unary = guard.open(_call(PUBLISH))
    assert unary is not None
    unary.close()
    stream.close()
    assert guard.counts.publishes == {} and guard.counts.streams == {}


# --- the command line


def test_squall_auth_new_token_prints_a_token_and_its_hash(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from squall_server import cli

    assert cli.main(["auth", "new-token"]) == 0
    token_line, hash_line = capsys.readouterr().out.splitlines()
    token = token_line.removeprefix("token: ")
    assert len(token) >= 43
    assert hash_line == f'token_sha256 = "{token_sha256(token)}"'


def test_squall_auth_hash_token_reads_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from squall_server import cli

    monkeypatch.setattr("sys.stdin", io.StringIO("token-a\n"))
    assert cli.main(["auth", "hash-token"]) == 0
    assert capsys.readouterr().out.strip() == HASH_A
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert cli.main(["auth", "hash-token"]) == 2
    assert "the token from stdin is empty" in capsys.readouterr().err


def test_a_bad_token_file_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    from squall_server import cli

    missing = tmp_path / "nope"
    assert (
        cli.main(["topic", "list", "--gateway", "127.0.0.1:1", "--token-file", str(missing)]) == 2
    )
    assert f"cannot read the token file {missing}" in capsys.readouterr().err


def test_auth_requires_tls_once_both_sections_exist() -> None:
    from squall_server.common.auth_config import require_tls

    require_tls(auth_enabled=True, tls_enabled=True)
    require_tls(auth_enabled=False, tls_enabled=False)
    with pytest.raises(ValueError, match=r"auth\.enabled: requires tls\.enabled = true"):
        require_tls(auth_enabled=True, tls_enabled=False)
