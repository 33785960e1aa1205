"""The chaos workload's honesty and bounds, without a cluster.

Goal: a publish is "fail" only when the library says nothing was stored; a gateway that
takes every call and never answers (a hung cluster) leaves every publish indeterminate,
never "fail" or "ok", and `Workload.stop` still returns, completing each running operation
as indeterminate and writing nothing afterwards. Every receipt that says duplicate is
recorded, so the checker can tell whether it points at a stored event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import squall
from chaos.checker import check_records
from chaos.history import HistoryWriter, read_history
from chaos.workload import Target, Workload, _Recorder, classify_publish_error
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2

HANG_S_MAX = 30.0


def test_only_a_certain_non_store_is_a_failure() -> None:
    assert classify_publish_error(squall.Indeterminate("lost", grpc.StatusCode.UNKNOWN)) == (
        "indeterminate"
    )
    assert classify_publish_error(squall.PublisherLost("gone", maybe_stored=True)) == (
        "indeterminate"
    )
    assert classify_publish_error(squall.PublisherLost("gone", maybe_stored=False)) == "fail"
    assert classify_publish_error(squall.Unavailable("nothing sent")) == "fail"
    assert (
        classify_publish_error(
            squall.ResourceExhausted("map full", grpc.StatusCode.RESOURCE_EXHAUSTED)
        )
        == "fail"
    )
    # Anything the library did not classify may have happened after the request left.
    assert classify_publish_error(RuntimeError("bug")) == "indeterminate"
    assert classify_publish_error(ValueError("the publisher is closed")) == "indeterminate"


def test_the_recorder_closes_running_operations_as_indeterminate_and_then_writes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "h.jsonl"
    with HistoryWriter(path) as history:
        recorder = _Recorder(history)
        done = recorder.invoke(process="pub-1", op="publish", events=[])
        running = recorder.invoke(process="pub-2", op="publish", events=[])
        recorder.complete(done, "ok", offsets=[0])
        assert recorder.close() == 1
        recorder.complete(running, "ok", offsets=[1])  # too late: already settled
        recorder.deliver(process="sub-1", events=[{"offset": 0, "value": "x"}])
    records = read_history(path)
    completes = [(r["id"], r["outcome"]) for r in records if r["type"] == "complete"]
    assert completes == [(done, "ok"), (running, "indeterminate")]
    assert not [r for r in records if r["type"] == "deliver"]


class _HungCluster(
    broker_pb2_grpc.TopicManagerServicer,
    broker_pb2_grpc.PublisherServicer,
    broker_pb2_grpc.SubscriberServicer,
    broker_pb2_grpc.PushSubscriptionsServicer,
):
    """Creates topics and hands out proxies to itself, then never answers a publish."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.address = ""

    def _hang(self, context: grpc.ServicerContext) -> None:
        # Bounded: the fixture releases it; the call's own deadline ends it earlier.
        self.release.wait(HANG_S_MAX)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    def CreateTopic(self, request: Any, context: grpc.ServicerContext) -> Any:
        return broker_pb2.CreateTopicResponse(topic=common_pb2.Topic(name=request.name))

    def GetPublisher(self, request: Any, context: grpc.ServicerContext) -> Any:
        endpoint = common_pb2.NodeEndpoint(node_id="n1", replica_address=self.address)
        return broker_pb2.GetPublisherResponse(topic=request.topic, endpoints=[endpoint])

    def GetNonReplicatedPublisher(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.GetPublisher(request, context)

    def Publish(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._hang(context)

    def PublishStream(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        self._hang(context)
        yield broker_pb2.PublishResponse()

    def Subscribe(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._hang(context)
        yield broker_pb2.SubscribeResponse()

    def SubscribeAndGetPublisher(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._hang(context)

    def GetSubscribers(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._hang(context)


@pytest.fixture
def hung_cluster() -> Iterator[_HungCluster]:
    servicer = _HungCluster()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=64))
    broker_pb2_grpc.add_TopicManagerServicer_to_server(servicer, server)
    broker_pb2_grpc.add_PublisherServicer_to_server(servicer, server)
    broker_pb2_grpc.add_SubscriberServicer_to_server(servicer, server)
    broker_pb2_grpc.add_PushSubscriptionsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.address = f"127.0.0.1:{port}"
    server.start()
    try:
        yield servicer
    finally:
        servicer.release.set()
        server.stop(0).wait()


def test_against_a_hung_cluster_every_publish_is_indeterminate_and_stop_returns(
    hung_cluster: _HungCluster, tmp_path: Path
) -> None:
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path) as history:
        workload = Workload(
            Target([hung_cluster.address], "127.0.0.1"),
            history,
            seed=3,
            topics=["t"],
            call_timeout_s=0.3,
            retry_total_ms=300,
        )

        async def scenario() -> None:
            await workload.start()
            # Every publisher (gateway, both proxies, plain, unary calls) has finished a
            # publish.
            deadline = asyncio.get_running_loop().time() + 20
            while len(_publish_processes(path)) < 5:
                assert asyncio.get_running_loop().time() < deadline, "publishers never started"
                await asyncio.sleep(0.05)
            # Bounded: if stop() hung on the silent cluster this fails instead of waiting.
            await asyncio.wait_for(workload.stop(drain_timeout_s=1.0), HANG_S_MAX)

        asyncio.run(scenario())
        written = path.read_text()
        history.write("end", reason="completed")
    assert workload.errors == []
    records = read_history(path)
    invokes = {r["id"]: r for r in records if r["type"] == "invoke"}
    completes = [r for r in records if r["type"] == "complete"]
    assert sorted(r["id"] for r in completes) == sorted(invokes)
    publish_outcomes = {r["outcome"] for r in completes if invokes[r["id"]]["op"] == "publish"}
    assert publish_outcomes == {"indeterminate"}
    assert not [r for r in records if r["type"] == "deliver"]
    # Nothing was written after stop() returned but the line the test added.
    assert path.read_text().count("\n") == written.count("\n") + 1


def _publish_processes(path: Path) -> set[str]:
    """The publishers that have finished at least one publish."""
    records = read_history(path)
    publishes = {r["id"]: r for r in records if r["type"] == "invoke" and r["op"] == "publish"}
    return {
        publishes[r["id"]]["process"]
        for r in records
        if r["type"] == "complete" and r["id"] in publishes
    }


class _AlwaysDuplicate(_HungCluster):
    """Answers every publish "duplicate, at offset 7 + i" and stores nothing: a master
    whose dedupe state outlived the topic (issue 14, item 6)."""

    @staticmethod
    def _receipts(request: Any) -> broker_pb2.PublishResponse:
        response = broker_pb2.PublishResponse(request_id=request.request_id)
        count = len(request.events)
        if request.compact_receipts:
            response.batch.count = count
            response.batch.master_id = "n1"
            for i in range(count):
                response.batch.duplicates.add(index=i, offset=7 + i, lsn=1, epoch=1)
        else:
            for i in range(count):
                response.receipts.add(offset=7 + i, lsn=1, epoch=1, duplicate=True, master_id="n1")
        return response

    def Publish(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._receipts(request)

    def PublishStream(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        for request in request_iterator:
            yield self._receipts(request)


def test_duplicate_receipts_are_recorded_and_one_pointing_at_nothing_is_a_finding(
    tmp_path: Path,
) -> None:
    servicer = _AlwaysDuplicate()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=64))
    broker_pb2_grpc.add_TopicManagerServicer_to_server(servicer, server)
    broker_pb2_grpc.add_PublisherServicer_to_server(servicer, server)
    broker_pb2_grpc.add_SubscriberServicer_to_server(servicer, server)
    broker_pb2_grpc.add_PushSubscriptionsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.address = f"127.0.0.1:{port}"
    server.start()
    path = tmp_path / "history.jsonl"
    try:
        with HistoryWriter(path) as history:
            history.write("run", seed=5, nodes=["n1"], gateways=["g1"], topics=["t"])
            workload = Workload(
                Target([servicer.address], "127.0.0.1"),
                history,
                seed=5,
                topics=["t"],
                subscribers=0,
                push_subscribers=0,
                call_timeout_s=0.5,
            )

            async def scenario() -> None:
                await workload.start()
                deadline = asyncio.get_running_loop().time() + 20
                while len(_publish_processes(path)) < 5:
                    assert asyncio.get_running_loop().time() < deadline, "no publishes"
                    await asyncio.sleep(0.05)
                await asyncio.wait_for(workload.stop(drain_timeout_s=1.0), HANG_S_MAX)

            asyncio.run(scenario())
            # The stores hold nothing of topic t.
            history.write("final_log", node="n1", topic="t", commit_lsn=0, events=[])
            history.write("end", reason="completed")
    finally:
        servicer.release.set()
        server.stop(0).wait()
    records = read_history(path)
    invokes = {r["id"]: r for r in records if r["type"] == "invoke"}
    oks = [r for r in records if r["type"] == "complete" and r["outcome"] == "ok"]
    assert {invokes[r["id"]]["path"] for r in oks} >= {
        "gateway",
        "replicated",
        "non_replicated",
        "gateway_unary",
    }
    for complete in oks:
        events = invokes[complete["id"]]["events"]
        assert complete["duplicates"] == list(range(len(events))), complete
        assert complete["offsets"] == [7 + i for i in range(len(events))]
    report = check_records(records)
    assert "dup_receipts" in report.failed
    assert any("which holds nothing" in d for d in report.result("dup_receipts").details)
