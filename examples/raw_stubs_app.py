"""A Squall app that uses only the generated gRPC stubs, as an app in any language would.

It talks to a gateway with nothing but `squall.v1.*_pb2` / `*_pb2_grpc` (no client
library): creates a topic if it is missing, publishes five events with a publisher id and
sequence numbers (so a retried publish is stored once), then reads the topic from the
start without following and prints each event.

    python examples/raw_stubs_app.py --gateway 127.0.0.1:7100 --topic demo

The same calls, in the same order, are what a Go or Java app makes with stubs generated
from protos/ (see examples/README.md).
"""

from __future__ import annotations

import argparse
import sys
import uuid

import grpc

from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2

# Squall's events may be up to several MiB; gRPC's default receive limit is 4 MiB.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
TIMEOUT_S = 10.0


def ensure_topic(topics: broker_pb2_grpc.TopicManagerStub, name: str) -> common_pb2.Topic:
    """Retrieves the topic, creating it when it does not exist yet."""
    retrieve = broker_pb2.RetrieveTopicRequest(name=name)
    try:
        return topics.RetrieveTopic(retrieve, timeout=TIMEOUT_S).topic
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.NOT_FOUND:
            raise
    try:
        request = broker_pb2.CreateTopicRequest(name=name, kind=common_pb2.TOPIC_KIND_REPLICATED)
        return topics.CreateTopic(request, timeout=TIMEOUT_S).topic
    except grpc.RpcError as err:
        # Another app created it between our two calls: use theirs.
        if err.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
        return topics.RetrieveTopic(retrieve, timeout=TIMEOUT_S).topic


def publish(publisher: broker_pb2_grpc.PublisherStub, topic: str, count: int) -> None:
    """Publishes `count` events in one batch with a publisher id and sequences 1..count."""
    # A stable id per logical producer makes retries idempotent: the master stores an
    # event once per (publisher_id, sequence). Retry UNAVAILABLE, UNKNOWN and
    # DEADLINE_EXCEEDED with the SAME request; never renumber.
    publisher_id = f"raw-stubs-example-{uuid.uuid4().hex[:8]}"
    request = broker_pb2.PublishRequest(
        topic=topic,
        publisher_id=publisher_id,
        events=[
            common_pb2.EventData(
                key=f"key-{i}".encode(),
                payload=f"hello #{i} from raw stubs".encode(),
                sequence=i,
                headers={"content-type": "text/plain"},
            )
            for i in range(1, count + 1)
        ],
    )
    response = publisher.Publish(request, timeout=TIMEOUT_S)
    for receipt in response.receipts:
        print(
            f"published offset={receipt.offset} lsn={receipt.lsn} epoch={receipt.epoch} "
            f"duplicate={receipt.duplicate} holders={len(receipt.holders)}"
        )


def read_all(subscriber: broker_pb2_grpc.SubscriberStub, topic: str) -> int:
    """Prints every committed event from the earliest one; returns how many."""
    request = broker_pb2.SubscribeRequest(
        topic=topic, start=broker_pb2.START_POSITION_EARLIEST, follow=False
    )
    count = 0
    # follow=False: the server ends the stream after the events committed at the start.
    for response in subscriber.Subscribe(request, timeout=60.0):
        for event in response.events:
            count += 1
            print(
                f"{event.offset}\t{event.key.decode(errors='replace')}\t"
                f"{event.payload.decode(errors='replace')}\t"
                f"(publisher {event.publisher_id} #{event.sequence})"
            )
    return count


def main(argv: list[str] | None = None) -> int:
    """Runs the example against a gateway."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="127.0.0.1:7100", help="gateway host:port")
    parser.add_argument("--topic", default="raw-stubs-demo", help="topic to use")
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.gateway, options=CHANNEL_OPTIONS) as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        try:
            topic = ensure_topic(topics, args.topic)
            print(f"topic {topic.name}: next_offset={topic.next_offset}")
            publish(broker_pb2_grpc.PublisherStub(channel), topic.name, 5)
            count = read_all(broker_pb2_grpc.SubscriberStub(channel), topic.name)
        except grpc.RpcError as err:
            print(f"raw_stubs_app: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(f"read {count} events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
