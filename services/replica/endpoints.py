"""The narrow interfaces the replica's servicers and its master's work use of the node, one
per kind of caller.

A servicer is a thin adapter: it names here just what it calls, and ``ReplicaNode``
(``node.py``) is the one implementation (``__main__`` hands it to each servicer, where
mypy checks that it fits). A test or a simulator may hand a servicer anything else that
does. The master's work (``MasterWork``: push delivery, topic links) takes the node the
same way (``ReplicaNode`` hands itself over, checked there). What the coordinator's
``ReplicaControl`` servicer, cluster shutdown, hand-off and the metrics sampler use is in
``control_endpoints.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.telemetry import Telemetry
from squall_server.replica.commands import Command, Planned
from squall_server.replica.slave_side import BatchAcks
from squall_server.replica.store import Store, TopicInfo
from squall_server.replica.transient import TransientTopics

if TYPE_CHECKING:  # (these import the node's module for their own annotations)
    from squall_server.replica.links import LinkForwarding
    from squall_server.replica.push import PushDelivery
    from squall_server.replica.telemetry import PublishedTraces, PublishWatch


class RoleView(Protocol):
    """Which replica this is and the role and epoch it holds now."""

    @property
    def node(self) -> NodeConfig: ...

    @property
    def role(self) -> common_pb2.Role.ValueType: ...

    @property
    def epoch(self) -> int: ...


class Traced(Protocol):
    """Where a caller records its spans and finds the publishes they link to."""

    @property
    def telemetry(self) -> Telemetry: ...

    @property
    def published_traces(self) -> PublishedTraces: ...


class FaultSink(Protocol):
    """Where a servicer reports a fault of this node's store (a checksum error)."""

    def report_fault(self, reason: str) -> None: ...


class SlaveEndpoint(Protocol):
    """What a slave does with its master's replication stream (``slave_side``)."""

    @property
    def node(self) -> NodeConfig: ...

    async def replication_hello(
        self, hello: replica_pb2.ReplicationHello
    ) -> tuple[int, replica_pb2.ReplicationPosition]: ...

    def replication_batch(
        self, stream: int, batch: replica_pb2.EntryBatch
    ) -> AsyncIterator[replica_pb2.ReplicationAck]: ...

    async def replication_batch_acks(
        self, stream: int, batch: replica_pb2.EntryBatch
    ) -> BatchAcks: ...

    async def replication_snapshot(
        self, stream: int, chunk: replica_pb2.SnapshotChunk
    ) -> list[replica_pb2.ReplicationAck]: ...

    def replication_heartbeat(
        self, stream: int, heartbeat: replica_pb2.ReplicationHeartbeat
    ) -> replica_pb2.ReplicationAck: ...


class SyncSourceEndpoint(FaultSink, Protocol):
    """A sync source answering a new master's reorganization fetch (``sync_source``)."""

    @property
    def node(self) -> NodeConfig: ...

    def fetch_log(
        self, request: replica_pb2.FetchLogRequest
    ) -> AsyncIterator[replica_pb2.FetchLogResponse]: ...


class ReplicationEndpoint(SlaveEndpoint, SyncSourceEndpoint, Protocol):
    """The Replication servicer's: both sides a replica serves to the other replicas."""


class Reads(FaultSink, RoleView, Traced, Protocol):
    """Committed reads: topics, events, cursors and what is not committed yet."""

    @property
    def config(self) -> ClusterConfig: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def store(self) -> Store: ...

    @property
    def transient(self) -> TransientTopics: ...

    @property
    def commit_lsn(self) -> int: ...

    def topic(self, name: str) -> TopicInfo: ...

    def visible_end(self, topic: str) -> int | None: ...

    def commit_signal(self) -> asyncio.Event: ...

    def following(self) -> contextlib.AbstractContextManager[None]: ...


class Writes(Protocol):
    """Writes through the master's writer (``writer``), refused where the core says."""

    def check_writable(self) -> None: ...

    async def write(self, command: Command) -> Planned: ...


class SubscribeEndpoint(Reads, Writes, Protocol):
    """The Subscriber servicer's and its shared subscriptions' (``shared_master``): reads,
    and the cursor and acknowledgement writes."""


class PublishEndpoint(FaultSink, Traced, Protocol):
    """The Publisher servicer's: queue publishes in order; hold a call for a role."""

    @property
    def node(self) -> NodeConfig: ...

    @property
    def config(self) -> ClusterConfig: ...

    @property
    def epoch(self) -> int: ...

    def start_publish(
        self, request: broker_pb2.PublishRequest, trace: PublishWatch | None = None
    ) -> asyncio.Future[common_pb2.BatchReceipt]: ...

    def begin_publish(
        self,
        request: broker_pb2.PublishRequest,
        trace: PublishWatch | None = None,
        *,
        alone: bool = False,
    ) -> asyncio.Future[Planned]: ...

    def start_publish_parts(
        self, parts: Sequence[broker_pb2.PublishRequest]
    ) -> asyncio.Future[list[common_pb2.BatchReceipt | BaseException]]: ...

    async def wait_for_role(self, unreachable: frozenset[str], timeout_s: float) -> None: ...


class TopicsEndpoint(Reads, Writes, Protocol):
    """The TopicManager servicer's: topics and topic links, and where the master is."""

    @property
    def master(self) -> NodeConfig | None: ...

    @property
    def last_lsn(self) -> int: ...

    @property
    def links(self) -> LinkForwarding: ...


class PushEndpoint(TopicsEndpoint, Protocol):
    """The PushSubscriptions servicer's: the topics' and the master's push delivery."""

    @property
    def push(self) -> PushDelivery: ...


class MasterWorkEndpoint(RoleView, Protocol):
    """What every task of the master's work (``master_tasks``) checks: is this replica
    still the master of the epoch it started in?"""

    @property
    def failed_reason(self) -> str: ...


class CommittedLog(Protocol):
    """Reading committed events as they commit, and writing through the master's log."""

    @property
    def config(self) -> ClusterConfig: ...

    @property
    def store(self) -> Store: ...

    def visible_end(self, topic: str) -> int | None: ...

    def commit_signal(self) -> asyncio.Event: ...

    async def write(self, command: Command) -> Planned: ...

    async def write_with_next(self, command: Command, within_s: float) -> Planned: ...


class ForwardingEndpoint(MasterWorkEndpoint, CommittedLog, Protocol):
    """Topic link forwarding's (``links``): a link's lag is measured on the clock."""

    @property
    def clock(self) -> Clock: ...


class DeliveryEndpoint(MasterWorkEndpoint, CommittedLog, Traced, Protocol):
    """Push delivery's (``push``): transient topics' live events, and the delivery spans
    that link to the traced publishes."""

    @property
    def transient(self) -> TransientTopics: ...

    @property
    def clock(self) -> Clock: ...
