"""Squall's Python client: topics, idempotent pipelined publishing and subscriptions.

    import squall

    with squall.connect("127.0.0.1:7100") as client:
        client.create_topic("orders")
        topic = client.topic("orders")
        with topic.publisher() as publisher:
            receipts = publisher.publish_many(b"event %d" % i for i in range(10_000))
        with topic.subscribe("billing", follow=False) as subscription:
            for message in subscription:
                handle(message)
                subscription.ack(message)

Everything public is gathered here; the underscore modules are private. Errors are
`SquallError` subclasses (see `squall._errors` for the tree). A publish whose outcome is
unknown is retried for you with the same publisher id and sequences, for as long as the
time budget `connect(retry_total_ms_max=...)` allows (10 s by default; backoff from
`retry_backoff_initial_ms` to `retry_backoff_max_ms`; `retry_attempts_max` is an optional
cap on attempts, 0 for none, the default, and 1 to turn retrying off); `Indeterminate`
means the budget ran out and the events may or may not have been stored.
`classify_code`, `retryable`, `overall` and `RetryPolicy` are the pure retry rules, shared
with the gateway (they live in `squall.wire.retry`; `squall.wire` holds what the library
and the services agree on across the wire, without grpc). The generated protobuf modules
live in `squall.v1`; `with_token(channel, token)` sends a bearer token on a channel of the
app's own that calls them.

Publishers (`Topic.publisher`): by default every publish goes through the gateway, which
follows the master (the app needs to reach the gateway only). `replicated=True` asks for
IceStorm's replicated publisher proxy: the library binds straight to one replica and
fails over to the others, following a slave's redirect to the master, reporting each move
(`on_rebind`, `Receipt.rebound`). `replicated=False` asks for the non-replicated proxy: the
master only, and `PublisherLost` on master loss instead of a silent move. Per-publisher
order holds within one session token (`Message.session_token`); a new stream or a move to
another replica starts a new token, and order across that point may change.

Subscriptions (`Topic.subscribe`) reconnect on a broken stream (bounded by the same retry
settings) and resume from the durable cursor or from the last offset delivered + 1, so
delivery is at-least-once; by default the library drops events at or below the last
offset it delivered (`dedupe=False` hands every copy to the app).

Asyncio apps use `squall.aio` (`await squall.aio.connect(...)` or `async with`): the same
keyword arguments, topics, idempotent pipelined publishers (the same retry rules, from
the same code in `squall._publish_rules`), both publisher proxies, subscriptions as async
iterators, a `grpc.aio` push endpoint, and the same error classes.

Push subscribers (`Topic.subscribe_push`, IceStorm's subscribeAndGetPublisher): the
cluster's master calls the app's own `squall.v1.PushSubscriber` service with batches of
committed events, with IceStorm's QoS (`reliability="ordered"`, `retry_count`);
`PushEndpoint` serves that service in-process and calls a callback per batch.
`Topic.push_subscribers()` and `Topic.unsubscribe_push()` manage them. Subscriptions are
replicated: after a failover the new master resumes from each one's durable cursor.
"""

import importlib
from typing import TYPE_CHECKING, Any

from squall._version import __version__

if TYPE_CHECKING:
    from squall._auth import with_token
    from squall._client import MESSAGE_BYTES_MAX, Client, Topic, channel_options, connect
    from squall._errors import (
        Aborted,
        AlreadyExists,
        AlreadySubscribed,
        DeadlineExceeded,
        FailedPrecondition,
        Indeterminate,
        InvalidArgument,
        NotFound,
        PermissionDenied,
        PublisherLost,
        ResourceExhausted,
        SquallError,
        Unauthenticated,
        Unavailable,
        classify,
        from_rpc_error,
    )
    from squall._proxy import Endpoint
    from squall._publisher import BATCH_EVENTS_MAX, Publisher
    from squall._push import PushDelivery, PushEndpoint, PushSubscriberInfo
    from squall._seek import SeekResult, SeekTarget, SubscriptionInfo
    from squall._shared import SharedConsumer, SharedMessage
    from squall._subscriber import Subscription
    from squall._tls import TlsOptions
    from squall._types import (
        ClusterStatus,
        ConfigMismatch,
        Holder,
        LinkInfo,
        LossEvent,
        Message,
        NodeStatus,
        OperatorRecord,
        Receipt,
        TopicInfo,
    )
    from squall.wire.retry import (
        INDETERMINATE_AFTER_SEND,
        RETRY_ATTEMPTS_MAX_DEFAULT,
        RETRY_BACKOFF_INITIAL_MS_DEFAULT,
        RETRY_BACKOFF_MAX_MS_DEFAULT,
        RETRY_TOTAL_MS_MAX_DEFAULT,
        Outcome,
        RetryPolicy,
        overall,
        retryable,
    )
    from squall.wire.retry import (
        POLICY_BOUNDS as RETRY_POLICY_BOUNDS,
    )
    from squall.wire.retry import classify as classify_code

# The public names, imported on first use (PEP 562): a process that needs only the
# generated code (`squall.v1`, as every Squall service does) or the wire rules
# (`squall.wire`) does not pay for the whole library at start-up (~85 ms of a service's
# ~450). tests/unit/test_client_lazy_exports.py keeps this table and the imports above
# the same.
_EXPORTS: dict[str, tuple[str, str]] = {
    "Aborted": ("squall._errors", "Aborted"),
    "AlreadyExists": ("squall._errors", "AlreadyExists"),
    "AlreadySubscribed": ("squall._errors", "AlreadySubscribed"),
    "BATCH_EVENTS_MAX": ("squall._publisher", "BATCH_EVENTS_MAX"),
    "Client": ("squall._client", "Client"),
    "ClusterStatus": ("squall._types", "ClusterStatus"),
    "ConfigMismatch": ("squall._types", "ConfigMismatch"),
    "DeadlineExceeded": ("squall._errors", "DeadlineExceeded"),
    "Endpoint": ("squall._proxy", "Endpoint"),
    "FailedPrecondition": ("squall._errors", "FailedPrecondition"),
    "Holder": ("squall._types", "Holder"),
    "INDETERMINATE_AFTER_SEND": ("squall.wire.retry", "INDETERMINATE_AFTER_SEND"),
    "Indeterminate": ("squall._errors", "Indeterminate"),
    "InvalidArgument": ("squall._errors", "InvalidArgument"),
    "LinkInfo": ("squall._types", "LinkInfo"),
    "LossEvent": ("squall._types", "LossEvent"),
    "MESSAGE_BYTES_MAX": ("squall._client", "MESSAGE_BYTES_MAX"),
    "Message": ("squall._types", "Message"),
    "NodeStatus": ("squall._types", "NodeStatus"),
    "NotFound": ("squall._errors", "NotFound"),
    "OperatorRecord": ("squall._types", "OperatorRecord"),
    "Outcome": ("squall.wire.retry", "Outcome"),
    "PermissionDenied": ("squall._errors", "PermissionDenied"),
    "Publisher": ("squall._publisher", "Publisher"),
    "PublisherLost": ("squall._errors", "PublisherLost"),
    "PushDelivery": ("squall._push", "PushDelivery"),
    "PushEndpoint": ("squall._push", "PushEndpoint"),
    "PushSubscriberInfo": ("squall._push", "PushSubscriberInfo"),
    "RETRY_ATTEMPTS_MAX_DEFAULT": ("squall.wire.retry", "RETRY_ATTEMPTS_MAX_DEFAULT"),
    "RETRY_BACKOFF_INITIAL_MS_DEFAULT": ("squall.wire.retry", "RETRY_BACKOFF_INITIAL_MS_DEFAULT"),
    "RETRY_BACKOFF_MAX_MS_DEFAULT": ("squall.wire.retry", "RETRY_BACKOFF_MAX_MS_DEFAULT"),
    "RETRY_POLICY_BOUNDS": ("squall.wire.retry", "POLICY_BOUNDS"),
    "RETRY_TOTAL_MS_MAX_DEFAULT": ("squall.wire.retry", "RETRY_TOTAL_MS_MAX_DEFAULT"),
    "Receipt": ("squall._types", "Receipt"),
    "ResourceExhausted": ("squall._errors", "ResourceExhausted"),
    "RetryPolicy": ("squall.wire.retry", "RetryPolicy"),
    "SeekResult": ("squall._seek", "SeekResult"),
    "SeekTarget": ("squall._seek", "SeekTarget"),
    "SharedConsumer": ("squall._shared", "SharedConsumer"),
    "SharedMessage": ("squall._shared", "SharedMessage"),
    "SquallError": ("squall._errors", "SquallError"),
    "Subscription": ("squall._subscriber", "Subscription"),
    "SubscriptionInfo": ("squall._seek", "SubscriptionInfo"),
    "TlsOptions": ("squall._tls", "TlsOptions"),
    "Topic": ("squall._client", "Topic"),
    "TopicInfo": ("squall._types", "TopicInfo"),
    "Unauthenticated": ("squall._errors", "Unauthenticated"),
    "Unavailable": ("squall._errors", "Unavailable"),
    "channel_options": ("squall._client", "channel_options"),
    "classify": ("squall._errors", "classify"),
    "classify_code": ("squall.wire.retry", "classify"),
    "connect": ("squall._client", "connect"),
    "from_rpc_error": ("squall._errors", "from_rpc_error"),
    "overall": ("squall.wire.retry", "overall"),
    "retryable": ("squall.wire.retry", "retryable"),
    "with_token": ("squall._auth", "with_token"),
}


if not TYPE_CHECKING:  # type checkers see the imports above; a typo stays an error there

    def __getattr__(name: str) -> Any:
        try:
            module, attribute = _EXPORTS[name]
        except KeyError:
            raise AttributeError(f"module 'squall' has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "BATCH_EVENTS_MAX",
    "INDETERMINATE_AFTER_SEND",
    "MESSAGE_BYTES_MAX",
    "RETRY_ATTEMPTS_MAX_DEFAULT",
    "RETRY_BACKOFF_INITIAL_MS_DEFAULT",
    "RETRY_BACKOFF_MAX_MS_DEFAULT",
    "RETRY_POLICY_BOUNDS",
    "RETRY_TOTAL_MS_MAX_DEFAULT",
    "Aborted",
    "AlreadyExists",
    "AlreadySubscribed",
    "Client",
    "ClusterStatus",
    "ConfigMismatch",
    "DeadlineExceeded",
    "Endpoint",
    "FailedPrecondition",
    "Holder",
    "Indeterminate",
    "InvalidArgument",
    "LinkInfo",
    "LossEvent",
    "Message",
    "NodeStatus",
    "NotFound",
    "OperatorRecord",
    "Outcome",
    "PermissionDenied",
    "Publisher",
    "PublisherLost",
    "PushDelivery",
    "PushEndpoint",
    "PushSubscriberInfo",
    "Receipt",
    "ResourceExhausted",
    "RetryPolicy",
    "SeekResult",
    "SeekTarget",
    "SharedConsumer",
    "SharedMessage",
    "SquallError",
    "Subscription",
    "SubscriptionInfo",
    "TlsOptions",
    "Topic",
    "TopicInfo",
    "Unauthenticated",
    "Unavailable",
    "__version__",
    "channel_options",
    "classify",
    "classify_code",
    "connect",
    "from_rpc_error",
    "overall",
    "retryable",
    "with_token",
]
