"""The PushSubscriptions servicer: a thin adapter from requests to the node's log and the
master's push delivery (docs/push-subscribers.md).

A subscribe is checked in the order the contract states and registers nothing unless
every check passed: master role (else the usual redirect), subscriber id, endpoint, QoS
and start position (INVALID_ARGUMENT), topic (NOT_FOUND), AlreadySubscribed
(ALREADY_EXISTS), the probe call to the endpoint (FAILED_PRECONDITION); the log entry
is written only then, and the batch builder checks the topic, the id and the limit
again against the state the entry will apply to.
"""

from __future__ import annotations

import logging

from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall_server.common import names
from squall_server.common.errors import Code, ServiceError, invalid
from squall_server.common.grpc_server import Context
from squall_server.replica import commands, push_policy
from squall_server.replica.endpoints import PushEndpoint
from squall_server.replica.server import TopicManager, abort
from squall_server.replica.store import CorruptRecordError, PushSubscriber, UnknownTopicError

log = logging.getLogger("squall.replica")

_START_POSITIONS = frozenset(broker_pb2.StartPosition.values())


def subscriber_info(
    node: PushEndpoint, subscriber: PushSubscriber
) -> broker_pb2.PushSubscriberInfo:
    """The wire form of a push subscriber, with the master's delivery status if it is here."""
    failures, last_error = node.push.status(subscriber.topic, subscriber.subscriber_id)
    qos = push_policy.Qos(ordered=subscriber.ordered, retry_count=subscriber.retry_count)
    return broker_pb2.PushSubscriberInfo(
        topic=subscriber.topic,
        subscriber_id=subscriber.subscriber_id,
        endpoint=subscriber.endpoint,
        qos=qos.to_map(),
        cursor=subscriber.cursor,
        created_ms=subscriber.created_ms,
        consecutive_failures=failures,
        last_error=last_error,
    )


def _checked(request: broker_pb2.SubscribeAndGetPublisherRequest) -> push_policy.Qos:
    """The request's QoS once every field checks out; INVALID_ARGUMENT otherwise."""
    try:
        names.validate_push_subscriber_id(request.subscriber_id)
        push_policy.check_endpoint(request.endpoint)
        qos = push_policy.parse_qos(request.qos)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    if request.start not in _START_POSITIONS:
        raise invalid(f"unknown start position {request.start}")
    return qos


class PushSubscriptions(broker_pb2_grpc.PushSubscriptionsServicer):
    """SubscribeAndGetPublisher, Unsubscribe and GetSubscribers."""

    def __init__(self, node: PushEndpoint) -> None:
        self.node = node

    async def SubscribeAndGetPublisher(
        self, request: broker_pb2.SubscribeAndGetPublisherRequest, context: Context
    ) -> broker_pb2.SubscribeAndGetPublisherResponse:
        node = self.node
        try:
            node.check_writable()
            qos = _checked(request)
            topic = node.topic(request.topic)
            if (
                request.start == broker_pb2.START_POSITION_OFFSET
                and topic.kind == common_pb2.TOPIC_KIND_REPLICATED
                and request.offset > topic.next_offset
            ):
                raise invalid(
                    f"offset {request.offset} is beyond the end of topic '{topic.name}' "
                    f"(next offset {topic.next_offset})"
                )
            if node.store.get_push_subscriber(request.topic, request.subscriber_id) is not None:
                raise ServiceError(
                    Code.ALREADY_EXISTS,
                    f"AlreadySubscribed: push subscriber '{request.subscriber_id}' is already "
                    f"subscribed to topic '{request.topic}'",
                )
            await node.push.probe(request.topic, request.subscriber_id, request.endpoint)
            plan = await node.write(
                commands.PushSubscribe(
                    topic=request.topic,
                    subscriber_id=request.subscriber_id,
                    endpoint=request.endpoint,
                    ordered=qos.ordered,
                    retry_count=qos.retry_count,
                    start=request.start,
                    offset=request.offset,
                )
            )
            node.push.refresh()
            publisher = TopicManager(node)._proxy(request.topic, replicated=True)
        except ServiceError as exc:
            await abort(context, exc)
        if plan.push is None:
            raise AssertionError("a committed push subscribe plans its subscriber")
        log.info(
            "push subscriber '%s' subscribed to topic '%s' at %s (qos %s, cursor %d, epoch=%d)",
            request.subscriber_id,
            request.topic,
            request.endpoint,
            qos.to_map(),
            plan.push.cursor,
            node.epoch,
        )
        return broker_pb2.SubscribeAndGetPublisherResponse(
            subscriber=subscriber_info(node, plan.push), publisher=publisher
        )

    async def Unsubscribe(
        self, request: broker_pb2.UnsubscribeRequest, context: Context
    ) -> broker_pb2.UnsubscribeResponse:
        try:
            await self.node.write(
                commands.PushUnsubscribe(request.topic, request.subscriber_id, "unsubscribed")
            )
        except ServiceError as exc:
            await abort(context, exc)
        self.node.push.refresh()
        log.info(
            "push subscriber '%s' of topic '%s' unsubscribed (epoch=%d)",
            request.subscriber_id,
            request.topic,
            self.node.epoch,
        )
        return broker_pb2.UnsubscribeResponse()

    async def GetSubscribers(
        self, request: broker_pb2.GetSubscribersRequest, context: Context
    ) -> broker_pb2.GetSubscribersResponse:
        node = self.node
        try:
            node.topic(request.topic)
            try:
                subscribers = node.store.list_push_subscribers(request.topic)
            except UnknownTopicError as exc:  # destroyed since the check above
                raise ServiceError(
                    Code.NOT_FOUND, f"topic '{request.topic}' does not exist"
                ) from exc
            except CorruptRecordError as exc:
                raise ServiceError(Code.DATA_LOSS, f"corrupt record, not served: {exc}") from exc
        except ServiceError as exc:
            await abort(context, exc)
        return broker_pb2.GetSubscribersResponse(
            subscribers=[subscriber_info(node, s) for s in subscribers]
        )
