"""A joined request's parts, begun as one write (``PublishParts``) and stored as one
entry, answer as parts sent one by one would.

The master begins an untraced joined request (``PublishRequest.parts``) as one write: one
topic lookup per topic, one queue item, one wait for its last LSN; with no slave of an
older release among its members, the parts' events are one ``PublishPartsOp`` entry. Each
part must still be what a request of its own would be: the same answer (receipts at the
same offsets, the same duplicate receipts, the same refusal; the LSN is the joined
entry's), the same events stored in the same order, and a slave applying the log must
hold the same. Two fresh one-node masters over the in-memory store, each behind its real
``Publisher.PublishStream``: one gets the joined requests, the other every part as a
request of its own, in the same order; their answers and events must match.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from deploy.processes import free_ports
from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.common.errors import INLINE_ERRORS, PUBLISH_ERRORS_KEY
from squall_server.common.telemetry import SCOPE, Telemetry
from squall_server.replica import commands, server
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import Store
from tests.unit.test_writer_riders import role_command

WAIT_S = 30.0  # generous: the machine is shared


def _config(tmp_path: Path, limits: str = "") -> ClusterConfig:
    ports = free_ports(3)  # together: ports picked one by one may repeat
    text = (
        '[cluster]\nname = "t"\n\n[[nodes]]\nid = "n1"\npriority = 1\n'
        f'coordinator_address = "127.0.0.1:{ports[0]}"\n'
        f'replica_address = "127.0.0.1:{ports[1]}"\ndata_dir = "n1"\n'
        f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{ports[2]}"\n'
        # Small commit batches: a joined request of more parts is queued in pieces.
        "\n[limits]\nmax_event_bytes = 64\ncommit_batch_max_entries = 4\n" + limits
    )
    config = parse_config(text, tmp_path / "cluster.toml")
    config.node("n1").data_dir.mkdir(parents=True, exist_ok=True)
    return config


class _Context:
    """A stream's context: inline errors asked, no deadline."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((PUBLISH_ERRORS_KEY, INLINE_ERRORS),)

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"the stream was aborted: {code} {details}")


def _part(
    topic: str,
    publisher_id: str,
    *sequences: int,
    payload: bytes = b"x",
    compact: bool = True,
) -> broker_pb2.PublishRequest:
    return broker_pb2.PublishRequest(
        topic=topic,
        publisher_id=publisher_id,
        session_token=f"{publisher_id}/s1",
        compact_receipts=compact,
        events=[common_pb2.EventData(payload=payload + b"%d" % s, sequence=s) for s in sequences],
    )


def _joined(*parts: broker_pb2.PublishRequest) -> broker_pb2.PublishRequest:
    request = broker_pb2.PublishRequest(topic=parts[0].topic, parts=parts)
    for number, part in enumerate(request.parts, 1):
        part.request_id = number
    return request


# Each a joined request, in order; the comments say what each part checks.
REQUESTS = [
    _joined(
        _part("a", "p1", 1),
        _part("b", "p2", 1),  # another topic
        _part("a", "p3", 1, payload=b"y" * 65),  # over max_event_bytes: fails alone
        _part("nope", "p4", 1),  # no such topic: fails alone
        _part("a", "p5", 1),
        _part("a", "p1", 1),  # a duplicate of this request's first part
        _part("t", "p6", 1),  # a transient topic: handed to subscribers at once
        _part("b", "p1", 2),
    ),
    # The same again (a retry after a lost answer): the stored parts are duplicates.
    _joined(_part("a", "p1", 1), _part("b", "p2", 1), _part("a", "p5", 1)),
    _joined(
        _part("a", "p2", 1),  # p2 used sequence 1 on topic b: refused
        _part("a", "p7", 5, 6, compact=False),  # two events, a receipt per event
        _part("b", "p7", 5),  # p7's sequence 5 is on topic a: refused
        _part("a", "p7", 6, 7),  # 6 a duplicate, 7 new
        _part("a", "p8", 1),
        _part("a", "p9", 1),
    ),
]


async def _started(config: ClusterConfig, observability: Telemetry | None = None) -> ReplicaNode:
    node = build_replica_node(
        config, config.node("n1"), Store.open_memory(), observability=observability
    )
    await node.start()
    await node.apply_role(role_command(common_pb2.ROLE_MASTER, 1, 1))
    for name in ("a", "b"):
        await node.write(commands.CreateTopic(name, common_pb2.TOPIC_KIND_REPLICATED))
    await node.write(commands.CreateTopic("t", common_pb2.TOPIC_KIND_TRANSIENT))
    return node


async def _stream(
    node: ReplicaNode, requests: Sequence[broker_pb2.PublishRequest]
) -> list[broker_pb2.PublishResponse]:
    """Every request on one PublishStream, all in flight at once; the answers in order."""

    async def incoming() -> AsyncIterator[broker_pb2.PublishRequest]:
        for request in requests:
            yield request

    stream = server.Publisher(node).PublishStream(incoming(), _Context())  # type: ignore[arg-type]
    return [response async for response in stream]


def _log(store: Store) -> list[tuple[str, int, str, int, bytes]]:
    return [
        (topic, event.offset, event.publisher_id, event.sequence, event.payload)
        for topic in ("a", "b")
        for event in store.read_events(topic, 0, 100)
    ]


def _without_lsns(answer: broker_pb2.PublishResponse) -> broker_pb2.PublishResponse:
    """The answer with every LSN cleared (a joined entry's LSN is shared by its parts)."""
    answer = broker_pb2.PublishResponse.FromString(answer.SerializeToString())
    answer.batch.ClearField("lsn")
    for duplicate in answer.batch.duplicates:
        duplicate.ClearField("lsn")
    for receipt in answer.receipts:
        receipt.ClearField("lsn")
    return answer


def test_joined_parts_answer_and_store_as_parts_sent_one_by_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        joined_node = await _started(_config(tmp_path / "joined"))
        alone_node = await _started(_config(tmp_path / "alone"))
        try:
            joined = await asyncio.wait_for(_stream(joined_node, REQUESTS), WAIT_S)
            alone = await asyncio.wait_for(
                _stream(alone_node, [part for request in REQUESTS for part in request.parts]),
                WAIT_S,
            )
            joined_log, alone_log = _log(joined_node.store), _log(alone_node.store)
            entries = joined_node.store.read_log(1, 1000)
        finally:
            await joined_node.stop()
            await alone_node.stop()

        assert [len(response.parts) for response in joined] == [
            len(request.parts) for request in REQUESTS
        ]
        answers = [part for response in joined for part in response.parts]
        assert [a.request_id for a in answers] == [p.request_id for r in REQUESTS for p in r.parts]
        for answer, single in zip(answers, alone, strict=True):
            if single.HasField("error"):
                # A stream's inline error carries no request id; a part's carries its own.
                single.request_id = answer.request_id
            assert _without_lsns(answer) == _without_lsns(single)
        assert joined_log == alone_log
        # A slave applying the joined master's log holds the same events.
        slave = Store.open_memory()
        slave.append(entries, sync=False)
        assert _log(slave) == joined_log

        # Each stored part's receipt names a PublishPartsOp entry holding its events; the
        # joined requests took fewer entries than their stored parts.
        operations = {e.lsn: replica_pb2.Operation.FromString(e.operation) for e in entries}
        parts = [p for r in REQUESTS for p in r.parts]
        stored = [
            (part, answer)
            for part, answer in zip(parts, answers, strict=True)
            if part.topic != "t"  # transient: handed to subscribers, not logged
            and answer.HasField("batch")
            and answer.batch.count > len(answer.batch.duplicates)
        ]
        for part, answer in stored:
            operation = operations[answer.batch.lsn]
            assert operation.WhichOneof("op") == "publish_parts"
            assert any(
                (op.topic, op.first_offset) == (part.topic, answer.batch.first_offset)
                for op in operation.publish_parts.parts
            )
        assert len({answer.batch.lsn for _, answer in stored}) < len(stored)

        first, again, third = (list(response.parts) for response in joined)
        assert [(p.batch.first_offset, p.batch.lsn > 0) for p in first if p.HasField("batch")][
            :2
        ] == [(0, True), (0, True)]
        assert [first[2].error.code, first[3].error.code] == ["INVALID_ARGUMENT", "NOT_FOUND"]
        # The request's own duplicate points at its first part's event.
        assert first[5].batch.duplicates[0].offset == first[0].batch.first_offset
        assert first[5].batch.duplicates[0].lsn == first[0].batch.lsn
        assert all(len(p.batch.duplicates) == 1 for p in again)
        assert [third[0].error.code, third[2].error.code] == ["INVALID_ARGUMENT"] * 2
        assert len(third[1].receipts) == 2
        assert [d.index for d in third[3].batch.duplicates] == [0]
        # Topic a holds p1, p5, then p7's 5, 6, 7, p8, p9: no refused part left a trace.
        assert [(p, s) for t, _, p, s, _ in joined_log if t == "a"] == [
            ("p1", 1),
            ("p5", 1),
            ("p7", 5),
            ("p7", 6),
            ("p7", 7),
            ("p8", 1),
            ("p9", 1),
        ]

    asyncio.run(scenario())


def test_a_joined_request_to_a_master_that_cannot_write_fails_every_part_alone(
    tmp_path: Path,
) -> None:
    """A replica that is not master answers each part with the refusal (the request is
    not refused whole: the client's parts are separate publishes)."""

    async def scenario() -> None:
        config = _config(tmp_path)
        node = build_replica_node(config, config.node("n1"), Store.open_memory())
        await node.start()
        try:
            (response,) = await asyncio.wait_for(_stream(node, REQUESTS[:1]), WAIT_S)
        finally:
            await node.stop()
        assert len(response.parts) == len(REQUESTS[0].parts)
        codes = {part.error.code for part in response.parts}
        assert len(codes) == 1 and "" not in codes

    asyncio.run(scenario())


def _metered() -> tuple[Telemetry, InMemoryMetricReader]:
    """Metrics on, traces off: the telemetry a node records into, and its reader."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    observed = Telemetry(
        trace.NoOpTracer(), provider.get_meter(SCOPE), tracing=False, metering=True
    )
    return observed, reader


def _publish_metrics(reader: InMemoryMetricReader) -> tuple[int, int]:
    """(events acknowledged, commit latencies recorded) as the node's metrics say."""
    events = latencies = 0
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if metric.name == "squall.replica.events.in":
                        events += point.value
                    elif metric.name == "squall.replica.commit.latency":
                        latencies += point.count
    return events, latencies


def test_with_metrics_on_joined_parts_count_as_parts_sent_one_by_one(tmp_path: Path) -> None:
    """Metrics on (not traces), a joined request still takes the one-write path, and the
    master's publish metrics count each acknowledged part as a publish of its own."""

    async def scenario() -> None:
        joined_telemetry, joined_reader = _metered()
        alone_telemetry, alone_reader = _metered()
        joined_node = await _started(_config(tmp_path / "joined"), joined_telemetry)
        alone_node = await _started(_config(tmp_path / "alone"), alone_telemetry)
        begun: list[int] = []
        start_parts = joined_node.start_publish_parts

        def counted(parts: Sequence[broker_pb2.PublishRequest]) -> Any:
            begun.append(len(parts))
            return start_parts(parts)

        joined_node.start_publish_parts = counted  # type: ignore[method-assign]
        try:
            joined = await asyncio.wait_for(_stream(joined_node, REQUESTS), WAIT_S)
            alone = await asyncio.wait_for(
                _stream(alone_node, [part for request in REQUESTS for part in request.parts]),
                WAIT_S,
            )
        finally:
            await joined_node.stop()
            await alone_node.stop()
        assert begun == [len(request.parts) for request in REQUESTS]
        acknowledged = sum(
            not part.HasField("error") for response in joined for part in response.parts
        )
        assert acknowledged == sum(not response.HasField("error") for response in alone) > 0
        assert _publish_metrics(joined_reader) == _publish_metrics(alone_reader)
        assert _publish_metrics(joined_reader)[1] == acknowledged

    asyncio.run(scenario())


def test_a_malformed_joined_request_is_refused_whole_naming_the_problem(tmp_path: Path) -> None:
    """Events beside parts, a part with parts of its own, or more parts than
    max_batch_events: INVALID_ARGUMENT naming the problem, and nothing is stored."""

    async def scenario() -> None:
        node = await _started(_config(tmp_path))
        limit = node.config.limits.max_batch_events
        with_events = _joined(_part("a", "p1", 1))
        with_events.events.add(payload=b"x", sequence=1)
        nested = _joined(_part("a", "p1", 1))
        nested.parts[0].parts.add(topic="a", publisher_id="p2")
        too_many = _joined(*(_part("a", f"p{n}", 1) for n in range(limit + 1)))
        try:
            answers = await asyncio.wait_for(_stream(node, [with_events, nested, too_many]), WAIT_S)
            stored = _log(node.store)
        finally:
            await node.stop()
        assert [(a.error.code, len(a.parts)) for a in answers] == [("INVALID_ARGUMENT", 0)] * 3
        assert "events or parts, not both" in answers[0].error.message
        assert "cannot have parts of its own" in answers[1].error.message
        assert (
            f"{limit + 1} parts in one request exceed max_batch_events" in answers[2].error.message
        )
        assert stored == []

    asyncio.run(scenario())


def test_joined_entries_stay_within_max_batch_bytes(tmp_path: Path) -> None:
    """A joined request may be as large as a gRPC message, and each part as large as a
    batch: its parts go into as many joined entries as keep each within max_batch_bytes,
    so every entry fits a replication message as a plain publish's does."""
    limit = 256

    async def scenario() -> None:
        node = await _started(_config(tmp_path, f"max_batch_bytes = {limit}\n"))
        try:
            request = _joined(*(_part("a", f"p{k}", 1, payload=b"0123456789") for k in range(12)))
            (response,) = await asyncio.wait_for(_stream(node, [request]), WAIT_S)
            entries = node.store.read_log(1, 1000)
            stored = _log(node.store)
        finally:
            await node.stop()

        assert all(answer.HasField("batch") for answer in response.parts)
        joined = {
            e.lsn: replica_pb2.Operation.FromString(e.operation)
            for e in entries
            if replica_pb2.Operation.FromString(e.operation).WhichOneof("op") == "publish_parts"
        }
        assert all(len(e.operation) <= limit for e in entries if e.lsn in joined)
        # More entries than the request's pieces of commit_batch_max_entries parts (3).
        assert len(joined) > 3
        for k, answer in enumerate(response.parts):
            assert [
                (op.publisher_id, op.first_offset)
                for op in joined[answer.batch.lsn].publish_parts.parts
                if op.publisher_id == f"p{k}"
            ] == [(f"p{k}", answer.batch.first_offset)]
        assert [(p, o) for _, o, p, _, _ in stored] == [(f"p{k}", k) for k in range(12)]

    asyncio.run(scenario())
