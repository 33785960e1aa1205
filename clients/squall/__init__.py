"""Squall's Python client: topics, idempotent pipelined publishing and subscriptions.

    import squall

    with squall.connect("127.0.0.1:7000") as client:
        client.create_topic("orders")
        topic = client.topic("orders")
        with topic.publisher() as publisher:
            receipts = publisher.publish_many(b"event %d" % i for i in range(10_000))
        with topic.subscribe("billing", follow=False) as subscription:
            for message in subscription:
                handle(message)
                subscription.ack(message)

Everything public is gathered here; the underscore modules are private. Errors are
`SquallError` subclasses (see `squall._errors` for the tree); `Indeterminate` means a
publish may or may not have been stored, and republishing it with the same publisher id
and sequences is safe. The generated protobuf modules live in `squall.v1`.
"""

from squall._client import MESSAGE_BYTES_MAX, Client, Topic, channel_options, connect
from squall._errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    Indeterminate,
    InvalidArgument,
    NotFound,
    Outcome,
    PermissionDenied,
    ResourceExhausted,
    SquallError,
    Unauthenticated,
    Unavailable,
    classify,
    from_rpc_error,
)
from squall._publisher import BATCH_EVENTS_MAX, Publisher
from squall._subscriber import Subscription
from squall._types import ClusterStatus, Holder, Message, NodeStatus, Receipt, TopicInfo

__all__ = [
    "BATCH_EVENTS_MAX",
    "MESSAGE_BYTES_MAX",
    "AlreadyExists",
    "Client",
    "ClusterStatus",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Holder",
    "Indeterminate",
    "InvalidArgument",
    "Message",
    "NodeStatus",
    "NotFound",
    "Outcome",
    "PermissionDenied",
    "Publisher",
    "Receipt",
    "ResourceExhausted",
    "SquallError",
    "Subscription",
    "Topic",
    "TopicInfo",
    "Unauthenticated",
    "Unavailable",
    "channel_options",
    "classify",
    "connect",
    "from_rpc_error",
]
