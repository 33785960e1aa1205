"""The master's delivery stream to a push subscriber (`PushSubscriber.DeliverStream`).

Goals: with tracing off, the master delivers one batch after another on one stream per
subscriber (a message on an open stream, where a call per batch pays gRPC's call set-up
on both sides: bench/README.md, *Push delivery on a stream*); an app that serves
`Deliver` alone still gets every event (the stream is tried once, refused, and not
again for a while), and a stream refused for want of a thread is back after that while; a stream
delivery past `push_deliver_timeout_ms` is a failed delivery like a Deliver past its
deadline, and the retry goes on a new stream; a failed result on the stream counts as
the same status from Deliver would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import squall
from squall.v1 import push_pb2, push_pb2_grpc
from squall_server.replica import push
from tests.observability_harness import WAIT_S, InProcess, cluster_config


class _App(push_pb2_grpc.PushSubscriberServicer):
    """An app's push endpoint that records how each batch came; with `refuse` its
    DeliverStream fails at once with that code (UNIMPLEMENTED: as a servicer without it
    does; PERMISSION_DENIED: as an interceptor that knows Deliver alone might)."""

    def __init__(
        self, refuse: grpc.StatusCode | None = None, fail_first: str = "", refusals: int = -1
    ) -> None:
        self.lock = threading.Lock()
        self.refuse = refuse
        self.refusals = refusals  # streams refused before one is served (-1: all)
        self.streams_opened = 0
        self.on_stream: list[tuple[int, int]] = []  # (first offset, attempt)
        self.by_deliver: list[tuple[int, int]] = []
        self.probes = 0
        self._fail_first = fail_first  # "hang": the first stream request never answers
        self.release = threading.Event()

    def Deliver(
        self, request: push_pb2.PushDeliverRequest, context: grpc.ServicerContext
    ) -> push_pb2.PushDeliverResponse:
        with self.lock:
            if request.probe:
                self.probes += 1
            else:
                self.by_deliver.append((request.events[0].offset, request.attempt))
        return push_pb2.PushDeliverResponse()

    def DeliverStream(
        self, request_iterator: Iterator[push_pb2.PushDeliverRequest], context: grpc.ServicerContext
    ) -> Iterator[push_pb2.PushDeliverResult]:
        with self.lock:
            self.streams_opened += 1
            refused = self.refuse is not None and (
                self.refusals < 0 or self.streams_opened <= self.refusals
            )
        if refused:
            assert self.refuse is not None
            context.abort(self.refuse, "not here")
        for request in request_iterator:
            with self.lock:
                first = not self.on_stream
                self.on_stream.append((request.events[0].offset, request.attempt))
            if first and self._fail_first == "hang":
                self.release.wait(WAIT_S)  # past the master's deadline
            if first and self._fail_first == "internal":
                yield push_pb2.PushDeliverResult(code=13, details="app  down\n(for now)")
                continue
            yield push_pb2.PushDeliverResult()


def _run(tmp_path: Path, app: _App, scenario: Callable[[InProcess, str], None]) -> InProcess:
    """An in-process one-node cluster with `app` served beside it; runs scenario(cluster,
    app address) in a thread (it uses the blocking client)."""
    config = cluster_config(tmp_path, ["n1"])
    config = dataclasses.replace(
        config,
        timeouts=dataclasses.replace(
            config.timeouts,
            push_deliver_timeout_ms=300,
            push_retry_backoff_initial_ms=20,
            push_retry_backoff_max_ms=50,
        ),
    )
    cluster = InProcess(config)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    push_pb2_grpc.add_PushSubscriberServicer_to_server(app, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def main() -> None:
        await cluster.start()
        try:
            await cluster.elect("n1")
            await asyncio.to_thread(scenario, cluster, f"127.0.0.1:{port}")
        finally:
            app.release.set()
            await cluster.stop()
            server.stop(None)

    asyncio.run(main())
    return cluster


def _publish_one_at_a_time(
    cluster: InProcess, endpoint: str, count: int, delivered: Callable[[], int], retry: int = -1
) -> None:
    with squall.connect(cluster.gateway_address) as client:
        client.create_topic("orders")
        topic = client.topic("orders")
        topic.subscribe_push("app-1", endpoint, reliability="ordered", retry_count=retry)
        with topic.publisher() as publisher:
            for index in range(count):
                publisher.publish(b"event %d" % index)
                deadline = time.monotonic() + WAIT_S
                while delivered() <= index:  # each delivered before the next is published
                    assert time.monotonic() < deadline, f"event {index} not delivered"
                    time.sleep(0.01)


def test_batches_go_one_after_another_on_one_stream(tmp_path: Path) -> None:
    app = _App()
    _run(
        tmp_path,
        app,
        lambda cluster, endpoint: _publish_one_at_a_time(
            cluster, endpoint, 5, lambda: len(app.on_stream)
        ),
    )
    assert app.streams_opened == 1
    assert [first for first, _ in app.on_stream] == [0, 1, 2, 3, 4]
    assert (app.probes, app.by_deliver) == (1, [])  # the subscribe probe is a Deliver call


@pytest.mark.parametrize(
    "refuse", [grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED]
)
def test_an_app_serving_deliver_alone_gets_every_event(
    tmp_path: Path, refuse: grpc.StatusCode
) -> None:
    app = _App(refuse=refuse)
    _run(
        tmp_path,
        app,
        lambda cluster, endpoint: _publish_one_at_a_time(
            cluster, endpoint, 4, lambda: len(app.by_deliver)
        ),
    )
    assert app.streams_opened == 1  # refused once: Deliver for _STREAM_RETRY_S (30 s)
    assert app.by_deliver == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert app.on_stream == []


def test_a_stream_refused_for_want_of_a_thread_is_tried_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The threaded PushEndpoint refuses a stream when its threads are all taken
    # (RESOURCE_EXHAUSTED); they free up, so the master tries a stream again after a while
    # (Deliver meanwhile).
    monkeypatch.setattr(push, "_STREAM_RETRY_S", 0.5)
    app = _App(refuse=grpc.StatusCode.RESOURCE_EXHAUSTED, refusals=1)

    def scenario(cluster: InProcess, endpoint: str) -> None:
        with squall.connect(cluster.gateway_address) as client:
            client.create_topic("orders")
            topic = client.topic("orders")
            topic.subscribe_push("app-1", endpoint, reliability="ordered")
            with topic.publisher() as publisher:
                for index in range(6):
                    if index == 3:
                        time.sleep(0.8)  # past the retry interval
                    publisher.publish(b"event %d" % index)
                    deadline = time.monotonic() + WAIT_S
                    while len(app.by_deliver) + len(app.on_stream) <= index:
                        assert time.monotonic() < deadline, f"event {index} not delivered"
                        time.sleep(0.01)

    _run(tmp_path, app, scenario)
    # Refused once: Deliver until the interval passed, then one stream for the rest.
    assert app.by_deliver == [(0, 0), (1, 0), (2, 0)]
    assert app.on_stream == [(3, 0), (4, 0), (5, 0)]
    assert app.streams_opened == 2


def test_a_stream_delivery_past_the_deadline_fails_and_is_retried_on_a_new_stream(
    tmp_path: Path,
) -> None:
    app = _App(fail_first="hang")
    _run(
        tmp_path,
        app,
        lambda cluster, endpoint: _publish_one_at_a_time(
            cluster, endpoint, 2, lambda: len(app.on_stream) - 1
        ),
    )
    # The first stream's answer never came: the same batch again (attempt 1) on a second.
    assert app.on_stream[:2] == [(0, 0), (0, 1)]
    assert app.on_stream[2:] == [(1, 0)]
    assert app.streams_opened == 2
    assert app.by_deliver == []


def test_a_failed_result_on_the_stream_counts_as_that_status(tmp_path: Path) -> None:
    app = _App(fail_first="internal")
    infos: list[squall.PushSubscriberInfo] = []

    def scenario(cluster: InProcess, endpoint: str) -> None:
        _publish_one_at_a_time(cluster, endpoint, 1, lambda: len(app.on_stream), retry=0)
        with squall.connect(cluster.gateway_address) as client:
            deadline = time.monotonic() + WAIT_S
            while True:  # retryCount 0: removed on the first failure
                infos[:] = client.topic("orders").push_subscribers()
                if not infos or time.monotonic() > deadline:
                    break
                time.sleep(0.02)

    _run(tmp_path, app, scenario)
    assert app.on_stream == [(0, 0)]
    assert infos == []  # removed: INTERNAL counted like a failed Deliver
