"""Client authentication and per-topic permissions (docs/auth.md).

Three layers, the first two pure:

* which permission each public method needs, and on which request field's topic
  (``METHOD_RULES``);
* ``decide(method, topic, principal, member)``: allow, UNAUTHENTICATED or
  PERMISSION_DENIED, with the one sentence the caller sees. A denial names the principal
  and the topic asked for, never another topic; a call the caller may not make is
  refused before anything looks the topic up, so a denial does not reveal whether it
  exists;
* ``TokenBook``: the bearer token of a call to its principal, comparing SHA-256 digests in
  constant time, and ``AuthGuard``, the per-call adapter squall_server.common.call_guard runs.

A call from a cluster member (a node or gateway whose certificate the mutual-TLS
handshake verified, services/common/peer_identity.py) is trusted without a token: the
gateway has already checked the app's token before forwarding. Without TLS there are no
member identities, so every guarded call needs a token. Methods not listed here (the
internal Coordinator.Deliver, Replication.*, ReplicaControl.*, health, reflection) are
not this module's to guard; every other method of a public service must have a rule
(tests/unit/test_auth.py checks it against the protos, so a new RPC cannot ship unguarded).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from squall.wire.auth import AUTHORIZATION_KEY, BEARER_PREFIX
from squall_server.common.auth_config import PrincipalConfig
from squall_server.common.names import show_name

log = logging.getLogger("squall.auth")

# The scheme matched case-insensitively, as HTTP does.
_BEARER = BEARER_PREFIX.lower()
# The publisher ids of events forwarded by topic links (link_rules.LINK_PUBLISHER_PREFIX;
# tests/unit/test_auth.py checks they agree): `squall-link/<source cluster>/<LSN>` arrive
# through the public Publish from another cluster's link, so only the principal that
# cluster's link uses may publish under them, or an app could make a link's later events
# look like duplicates.
LINK_PUBLISHER_PREFIX = "squall-link/"


class Permission(enum.Enum):
    """What a method needs."""

    PUBLISH = "publish"
    SUBSCRIBE = "subscribe"
    # Publish or subscribe on the topic: enough to look it up.
    SEE = "see"
    ADMIN = "admin"
    # Any known principal (ListTopics answers only the topics it may see).
    AUTHENTICATED = "authenticated"


@dataclass(frozen=True)
class Rule:
    """One method's permission, the request field holding its topic, and how to say it."""

    permission: Permission
    topic_field: str = ""
    action: str = ""
    # A second topic the call makes the cluster publish into (a shared subscription's
    # dead-letter topic): the caller needs `publish` on it too, or the call would let it
    # write where it may not.
    publish_field: str = ""
    publish_action: str = ""
    # The request field holding a publisher id: ids under LINK_PUBLISHER_PREFIX need the
    # principal's link_from (decide_publisher_id).
    publisher_field: str = ""


def _rules() -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    manager = "/squall.v1.TopicManager/"
    rules[manager + "CreateTopic"] = Rule(Permission.ADMIN, "name", "create topic")
    rules[manager + "DestroyTopic"] = Rule(Permission.ADMIN, "name", "destroy topic")
    rules[manager + "RetrieveTopic"] = Rule(Permission.SEE, "name", "look up topic")
    rules[manager + "ListTopics"] = Rule(Permission.AUTHENTICATED)
    # Links move events between topics (and out of the cluster): the operator's call.
    rules[manager + "LinkTopic"] = Rule(Permission.ADMIN, "from_topic", "link topic")
    rules[manager + "UnlinkTopic"] = Rule(Permission.ADMIN, "from_topic", "unlink topic")
    rules[manager + "GetLinkInfo"] = Rule(Permission.ADMIN, action="read topic links")
    rules[manager + "RetryLink"] = Rule(Permission.ADMIN, "from_topic", "retry topic link")
    for name in ("GetPublisher", "GetNonReplicatedPublisher"):
        rules[manager + name] = Rule(Permission.PUBLISH, "topic", "publish to topic")
    for name in ("Publish", "PublishStream"):
        rules["/squall.v1.Publisher/" + name] = Rule(
            Permission.PUBLISH, "topic", "publish to topic", publisher_field="publisher_id"
        )
    rules["/squall.v1.Subscriber/CreateSharedSubscription"] = Rule(
        Permission.SUBSCRIBE,
        "topic",
        "subscribe to topic",
        publish_field="dead_letter_topic",
        publish_action="send dead letters to topic",
    )
    for name in (
        "Subscribe",
        "Ack",
        "Seek",
        "ListSubscriptions",
        "DeleteSubscription",
        "Pull",
        "AckMessages",
        "Nack",
        "ExtendDeadline",
    ):
        rules["/squall.v1.Subscriber/" + name] = Rule(
            Permission.SUBSCRIBE, "topic", "subscribe to topic"
        )
    for name in ("SubscribeAndGetPublisher", "Unsubscribe", "GetSubscribers"):
        rules["/squall.v1.PushSubscriptions/" + name] = Rule(
            Permission.SUBSCRIBE, "topic", "subscribe to topic"
        )
    rules["/squall.v1.ClusterAdmin/GetClusterStatus"] = Rule(
        Permission.ADMIN, action="read the cluster status"
    )
    for name, action in (
        ("GetStatus", "read a coordinator's status"),
        ("WatchGroupView", "watch the group view"),
        ("SetDesignatedPrimary", "run cluster commands"),
        ("SetQuorumOverride", "run cluster commands"),
        ("Shutdown", "run cluster commands"),
        ("TransferLeadership", "run cluster commands"),
        ("SetQuarantine", "run cluster commands"),
        ("AckLoss", "run cluster commands"),
        ("ChangeMembership", "change the cluster membership"),
    ):
        rules["/squall.v1.Coordinator/" + name] = Rule(Permission.ADMIN, action=action)
    return rules


METHOD_RULES: Mapping[str, Rule] = _rules()


class Verdict(enum.Enum):
    """The outcome of a permission check (names match grpc.StatusCode where refused)."""

    ALLOW = "OK"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"


@dataclass(frozen=True)
class Decision:
    """A verdict and the sentence the caller receives when refused."""

    verdict: Verdict
    message: str = ""

    @property
    def allowed(self) -> bool:
        return self.verdict is Verdict.ALLOW


ALLOWED = Decision(Verdict.ALLOW)
UNAUTHENTICATED_MESSAGE = (
    "missing or unknown token: send 'authorization: Bearer <token>' with a token this cluster knows"
)


def matches(globs: Iterable[str], topic: str) -> bool:
    """True if the topic matches any of the fnmatch-style globs (case-sensitive)."""
    return any(fnmatchcase(topic, glob) for glob in globs)


def may_see(principal: PrincipalConfig, topic: str) -> bool:
    """True if the principal may look the topic up (and see it in ListTopics)."""
    return (
        principal.admin or matches(principal.publish, topic) or matches(principal.subscribe, topic)
    )


def decide(
    method: str, topic: str, principal: PrincipalConfig | None, member: str | None
) -> Decision:
    """May this caller make this call on this topic? Pure: no I/O, no clock.

    `method` is a guarded method's full name (a key of METHOD_RULES); `topic` the request's
    topic ("" for methods without one); `principal` the token's principal (None: no or an
    unknown token); `member` the cluster member the caller's certificate names.
    """
    rule = METHOD_RULES[method]
    if member is not None:
        return ALLOWED
    if principal is None:
        return Decision(Verdict.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    permission = rule.permission
    if permission is Permission.AUTHENTICATED:
        return ALLOWED
    if permission is Permission.ADMIN:
        allowed = principal.admin
    elif permission is Permission.PUBLISH:
        allowed = matches(principal.publish, topic)
    elif permission is Permission.SUBSCRIBE:
        allowed = matches(principal.subscribe, topic)
    else:
        allowed = may_see(principal, topic)
    if allowed:
        return ALLOWED
    if rule.topic_field:
        what = f"{rule.action} {show_name(topic)}"
    else:
        what = rule.action
    needs = " (admin only)" if permission is Permission.ADMIN else ""
    return Decision(
        Verdict.PERMISSION_DENIED, f"principal '{principal.name}' may not {what}{needs}"
    )


def decide_publish_into(
    method: str, topic: str, principal: PrincipalConfig | None, member: str | None
) -> Decision:
    """May this caller make the cluster publish into ``topic`` (its rule's publish_field)?
    Pure, as decide; asked only for a non-empty topic of a method whose rule names one."""
    rule = METHOD_RULES[method]
    if member is not None or principal is None or not rule.publish_field:
        # No principal was refused by decide already; members are trusted.
        return ALLOWED
    if principal.admin or matches(principal.publish, topic):
        return ALLOWED
    return Decision(
        Verdict.PERMISSION_DENIED,
        f"principal '{principal.name}' may not {rule.publish_action} {show_name(topic)}",
    )


def decide_publisher_id(
    publisher_id: str, principal: PrincipalConfig | None, member: str | None
) -> Decision:
    """May this caller publish under ``publisher_id``? Pure, as decide; only ids under
    LINK_PUBLISHER_PREFIX are restricted: `squall-link/<cluster>/...` needs a link_from
    glob matching <cluster>; this cluster's own `squall-link/<LSN>` no principal may use
    (the replica writes those itself)."""
    if (
        member is not None
        or principal is None
        or not publisher_id.startswith(LINK_PUBLISHER_PREFIX)
    ):
        return ALLOWED
    cluster, slash, _ = publisher_id[len(LINK_PUBLISHER_PREFIX) :].partition("/")
    if slash and cluster and matches(principal.link_from, cluster):
        return ALLOWED
    needs = (
        f"a principal needs link_from matching '{cluster}' to carry that cluster's links"
        if slash and cluster
        else "this cluster's links write those themselves"
    )
    return Decision(
        Verdict.PERMISSION_DENIED,
        f"principal '{principal.name}' may not publish under publisher id "
        f"{show_name(publisher_id)}: the prefix '{LINK_PUBLISHER_PREFIX}' is reserved for "
        f"topic links ({needs})",
    )


def token_sha256(token: str) -> str:
    """The hex SHA-256 of a token, as [[auth.principals]].token_sha256 holds it."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the call's `authorization: Bearer <token>` metadata, if any."""
    for key, value in metadata or ():
        if key != AUTHORIZATION_KEY:
            continue
        text = value.decode("ascii", errors="replace") if isinstance(value, bytes) else value
        if text[: len(_BEARER)].lower() == _BEARER:
            return text[len(_BEARER) :].strip()
        return None
    return None


class TokenBook:
    """Tokens to principals, through their SHA-256 digests."""

    def __init__(self, principals: Iterable[PrincipalConfig]) -> None:
        self._by_digest = {bytes.fromhex(p.token_sha256): p for p in principals}

    def principal(self, token: str | None) -> PrincipalConfig | None:
        """The principal the token names, or None.

        The lookup is keyed by the token's SHA-256, which a caller cannot steer bit by bit,
        so its timing reveals nothing usable about a stored digest; the match is then
        confirmed with a constant-time comparison.
        """
        if not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(bytes.fromhex(found.token_sha256), digest):
            return None
        return found
