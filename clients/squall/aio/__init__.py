"""Squall's asyncio client: the same topics, publishers and subscriptions as `squall`, awaited.

    import squall.aio

    async with squall.aio.connect("127.0.0.1:7100") as client:
        await client.create_topic("orders")
        topic = await client.topic("orders")
        async with topic.publisher() as publisher:
            receipts = await publisher.publish_many(b"event %d" % i for i in range(10_000))
        async with topic.subscribe("billing", follow=False) as subscription:
            async for message in subscription:
                handle(message)
                await subscription.ack(message)

`connect` takes `squall.connect`'s keyword arguments and validates them the same way;
`await squall.aio.connect(...)` gives a `Client` to close with `await client.close()`.
Everything behaves as in the threaded client, from the same code where it is not I/O
(`squall._publish_rules`, `squall._proxy`, `squall.wire.retry`, `squall._subscriber`):

* Publishers are idempotent and pipelined over one stream (`inflight_batches_max`
  batches unanswered); an indeterminate batch is resent with the same publisher id and
  sequences within the client's retry time budget (`retry_total_ms_max`, 10 s by
  default); `Indeterminate` only once it ran out. `replicated=True` / `False` give the
  replicated and non-replicated publisher proxies (`on_rebind`, `PublisherLost`).
  Several tasks awaiting `publish` at once pipeline their events on the one stream;
  `await publisher.publish_async(...)` queues one event and returns a future for its
  receipt (events queued while the window is full go out as one batch).
* Subscriptions are async iterators that reconnect on a broken stream and resume from
  the durable cursor or the last offset delivered + 1, deduplicated by default.
* `PushEndpoint` serves push deliveries on the event loop to coroutine callbacks.

Errors are the `squall.SquallError` classes, re-exported here.
"""

from squall._errors import (
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
)
from squall._proxy import Endpoint
from squall._push import PushDelivery, PushSubscriberInfo
from squall._tls import TlsOptions
from squall._types import ClusterStatus, Message, Receipt, TopicInfo
from squall.aio._client import Client, Opening, Topic, connect
from squall.aio._publisher import Publisher
from squall.aio._push import AsyncDeliveryCallback, PushEndpoint
from squall.aio._shared import AsyncSharedConsumer
from squall.aio._subscriber import Subscription

__all__ = [
    "AlreadyExists",
    "AlreadySubscribed",
    "AsyncDeliveryCallback",
    "AsyncSharedConsumer",
    "Client",
    "ClusterStatus",
    "DeadlineExceeded",
    "Endpoint",
    "FailedPrecondition",
    "Indeterminate",
    "InvalidArgument",
    "Message",
    "NotFound",
    "Opening",
    "PermissionDenied",
    "Publisher",
    "PublisherLost",
    "PushDelivery",
    "PushEndpoint",
    "PushSubscriberInfo",
    "Receipt",
    "ResourceExhausted",
    "SquallError",
    "Subscription",
    "TlsOptions",
    "Topic",
    "TopicInfo",
    "Unauthenticated",
    "Unavailable",
    "connect",
]
