"""The coordinator's asyncio shell: gRPC, the state file and the OS clock around the
synchronous driver (``driver.py``).

``CoordinatorNode`` is generic over what it talks to: a ``PeerTransport`` (``GrpcPeers``:
one channel per peer, at most ``_PEER_INFLIGHT_MAX`` messages in flight each, fast
reconnects, TLS), a ``ReplicaLink`` to its own replica (``GrpcReplicaLink``: SetRole, the
health check and a transfer's PrepareHandoff), a ``Clock`` and a ``StateStore`` (the state
file). Its three loops only wait: the tick loop sleeps what ``CoordinatorDriver.tick``
says, the role loop sends the driver's newest role command and waits as ``role_outcome``
says, the watch loop asks ``watch`` and probes the replica when told to. Every decision is
the driver's, and the simulator (tests/sim/election_sim.py) runs that same driver over a
simulated network, replica, clock and in-memory state (why the split, not a virtual-time
asyncio loop: see driver.py). Everything runs on one asyncio loop, so inputs are applied
one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from squall.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall_server.common.clock import Clock, SystemClock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.grpc_server import channel_options, reconnect_options
from squall_server.common.ids import new_cluster_id
from squall_server.common.loss import loss_from_proto
from squall_server.common.loss_record import LOSS_RECORDS_MAX
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.telemetry import Telemetry, current
from squall_server.common.tls import handshake_failure, transport
from squall_server.coordinator import codec, handoff
from squall_server.coordinator.driver import (
    CoordinatorDriver,
    DriverTimings,
    Failure,
    FileStateStore,
    PeerTransport,
    ReplicaAnswer,
    ReplicaFailure,
    RoleNext,
    StateSaveError,
    StateStore,
)
from squall_server.coordinator.election import Election, ElectionConfig
from squall_server.coordinator.membership import Membership, MembershipChange
from squall_server.coordinator.messages import (
    ElectionStatus,
    NodeState,
    PeerMessage,
    Ready,
    Rejection,
    ReplicaReport,
    RoleCommand,
    RoleCommandKind,
    StoreState,
)
from squall_server.coordinator.persist import STATE_FILE_NAME
from squall_server.coordinator.telemetry import CoordinatorObserver

log = logging.getLogger("squall.coordinator")

_STORE_STATES = {
    common_pb2.STORE_STATE_EMPTY: StoreState.EMPTY,
    common_pb2.STORE_STATE_CLEAN: StoreState.CLEAN,
    common_pb2.STORE_STATE_DIRTY: StoreState.DIRTY,
}
_ROLES = {
    RoleCommandKind.MASTER: common_pb2.ROLE_MASTER,
    RoleCommandKind.FOLLOW: common_pb2.ROLE_SLAVE,
    RoleCommandKind.DEACTIVATE: common_pb2.ROLE_INACTIVE,
}
# Messages to one peer still in flight before new ones are dropped: the protocol
# tolerates loss, and a dead peer must not grow memory.
_PEER_INFLIGHT_MAX = 16
# Watchers of the group view each get a bounded queue; a watcher this far behind is
# only ever interested in the newest view.
_WATCH_QUEUE_MAX = 16
# Role-call failures that may mean the replica did not answer at all (a dead or hung
# process); any other status is an answer from a live replica.
_NO_ANSWER = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# The shortest time between two replacements of one peer's channel (GrpcPeers.heard_from).
_REDIAL_MIN_MS = 100
# Peer messages whose loss makes a group wait a timeout (a merge waits member_timeout_ms
# for an accept, a reorganization for its acks): one that is not delivered is logged, at
# most once a second per peer and kind. Probes and heartbeats go every interval, and a
# dead peer fails them all: those stay quiet.
_SAID_WHEN_LOST = frozenset(
    {"invitation", "accept", "ready", "ready_ack", "leadership_transfer", "leave", "step_aside"}
)
_LOST_LOG_INTERVAL_MS = 1000


def election_config(config: ClusterConfig, node_id: str) -> ElectionConfig:
    """The election's settings, copied from the cluster configuration."""
    t = config.timeouts
    return ElectionConfig(
        node_id=node_id,
        priorities={n.id: n.priority for n in config.nodes},
        heartbeat_interval_ms=t.heartbeat_interval_ms,
        member_timeout_ms=t.member_timeout_ms,
        probe_interval_ms=t.probe_interval_ms,
        merge_delay_ms_per_priority=t.merge_delay_ms_per_priority,
        replica_timeout_ms=t.replica_timeout_ms,
        agreed_settings=config.agreed_settings(),
        addresses={n.id: (n.coordinator_address, n.replica_address) for n in config.nodes},
        membership_version=config.membership_version,
        membership_epoch=config.membership_epoch,
        learners=frozenset(n.id for n in config.nodes if n.learner),
    )


def driver_timings(config: ClusterConfig) -> DriverTimings:
    """The driver's intervals, copied from the cluster configuration."""
    t = config.timeouts
    return DriverTimings(
        heartbeat_interval_ms=t.heartbeat_interval_ms,
        lease_ms=t.member_timeout_ms,
        rpc_timeout_ms=t.rpc_timeout_ms,
        replica_timeout_ms=t.replica_timeout_ms,
        store_stall_timeout_ms=t.store_stall_timeout_ms,
    )


def replica_failure(code: grpc.StatusCode, details: str) -> ReplicaFailure:
    """A failed role call as the driver takes it: no answer (maybe a dead or hung
    replica), a refusal of the role, or another error from a live replica."""
    kind = (
        Failure.NO_ANSWER
        if code in _NO_ANSWER
        else Failure.REFUSED
        if code == grpc.StatusCode.FAILED_PRECONDITION
        else Failure.ERROR
    )
    return ReplicaFailure(kind, code.name, details)


def replica_answer(command: RoleCommand, state: replica_pb2.ReplicaState) -> ReplicaAnswer:
    """The replica's answer to ``command`` (its state after the call), as the driver takes it."""
    syncing, epoch = "", 0
    if state.HasField("reorganization"):
        p = state.reorganization
        epoch = p.epoch
        syncing = (
            f"{p.phase} from {p.sync_source_id}, {p.entries_fetched} entries, snapshot at "
            f"LSN {p.snapshot_lsn}: {p.snapshot_chunks} chunks, {p.snapshot_records} "
            f"records, {p.elapsed_ms} ms (attempt {p.attempt})"
        )
    return ReplicaAnswer(
        report=ReplicaReport(
            cluster_id=state.cluster_id,
            last_epoch=state.last_epoch,
            last_lsn=state.last_lsn,
            store_state=_STORE_STATES.get(state.store_state, StoreState.EMPTY),
            active=state.role != common_pb2.ROLE_INACTIVE,
            command_seq=command.seq,
            shutdown_id=state.shutdown_id,
            joined=state.joined,
        ),
        fault_id=state.fault_id,
        fault_reason=state.fault_reason,
        syncing=syncing,
        syncing_epoch=epoch,
        store_stalled_ms=state.store_stalled_ms,
        slave_lags=tuple(
            (slave.node_id, slave.lag_entries)
            for slave in state.slaves
            if slave.state == "streaming"
        ),
        losses=tuple(loss_from_proto(loss) for loss in state.losses[:LOSS_RECORDS_MAX]),
        quorum_silent_ms=state.quorum_silent_ms,
        # A member still catching up holds no commit back (acks "group" waits for it once
        # it has caught up), so it is not dropped for its silence.
        slave_silences=tuple(
            (slave.node_id, slave.silent_ms) for slave in state.slaves if not slave.catching_up
        ),
    )


class ReplicaLink(handoff.HandoffLink, Protocol):
    """The coordinator's calls to its own replica (a transfer's too: ``prepare_handoff``)."""

    async def set_role(self, command: RoleCommand, reason: str) -> ReplicaAnswer | ReplicaFailure:
        """Send one role command (a renewal of the lease too)."""
        ...

    async def check_health(self) -> bool:
        """One health check: did the replica answer at all?"""
        ...

    async def close(self) -> None:
        """Release the connection."""
        ...


class GrpcPeers:
    """The peer transport over gRPC: one channel per peer, bounded in-flight sends."""

    def __init__(self, config: ClusterConfig, node_id: str, clock: Clock | None = None) -> None:
        self.node_id = node_id
        self._clock = clock if clock is not None else SystemClock()
        options = [
            *channel_options(config.limits.max_message_bytes),
            *reconnect_options(config.timeouts.heartbeat_interval_ms),
        ]
        self._links = transport(config, node_id)
        self._options = options
        self._addresses = {n.id: n.coordinator_address for n in config.nodes if n.id != node_id}
        self._channels = {
            peer: self._links.aio_channel(address, options=options)
            for peer, address in self._addresses.items()
        }
        self._peers = {
            peer: coordinator_pb2_grpc.CoordinatorStub(channel)
            for peer, channel in self._channels.items()
        }
        self._inflight = {peer: 0 for peer in self._peers}
        # The running node set's coordinator addresses (a membership change adds a node or
        # moves one); set by CoordinatorNode once its election exists.
        self.address_of: Callable[[str], str] | None = None
        self._redialed: dict[str, int] = {}  # peer -> when heard_from last replaced its channel
        self._closing_tasks: set[asyncio.Future[None]] = set()
        self._tls_refused: set[str] = set()  # peers whose TLS handshake failed (logged once)
        # (peer, message kind) -> when an undelivered one was last logged.
        self._lost_logged: dict[tuple[str, str], int] = {}
        # A message not delivered within the lease is of no use any more.
        self._timeout_s = config.timeouts.member_timeout_ms / 1000

    def send(self, message: PeerMessage) -> None:
        """Starts delivering one message (dropped if the peer has too many in flight)."""
        peer = message.to_node
        self._follow_address(peer)
        if peer not in self._peers or self._inflight[peer] >= _PEER_INFLIGHT_MAX:
            return
        self._inflight[peer] += 1
        task = asyncio.ensure_future(self._deliver_to(peer, codec.to_proto(message)))
        task.add_done_callback(lambda _: self._sent(peer))

    def heard_from(self, peer: str) -> None:
        """A message from ``peer`` proves it is up. A channel to it that is still waiting
        out its reconnect backoff (it failed while the peer was down or not yet started)
        fails every send at once until the backoff ends, up to a heartbeat later: an
        invitation sent to a node that just started was dropped that way, and the merge
        waited out member_timeout_ms for its answer. Such a channel is replaced by one that
        dials now (at most once a _REDIAL_MIN_MS per peer, so a link that fails one way
        only does not churn channels)."""
        channel = self._channels.get(peer)
        if channel is None or peer == self.node_id:
            return
        if (
            channel.get_state(try_to_connect=False)
            is not grpc.ChannelConnectivity.TRANSIENT_FAILURE
        ):
            return
        now = self._clock.monotonic_ms()
        if peer in self._redialed and now - self._redialed[peer] < _REDIAL_MIN_MS:
            return
        self._redialed[peer] = now
        self._retire(channel)  # its calls are failing anyway
        # Its own subchannel: from the shared pool it would get the one backing off.
        channel = self._links.aio_channel(
            self._addresses[peer], options=[*self._options, ("grpc.use_local_subchannel_pool", 1)]
        )
        self._channels[peer] = channel
        self._peers[peer] = coordinator_pb2_grpc.CoordinatorStub(channel)

    def _follow_address(self, peer: str) -> None:
        """Dial the address the running node set gives ``peer`` (a node added, or one
        replaced on a new machine, since the config file was written)."""
        address = self.address_of(peer) if self.address_of is not None else ""
        if not address or address == self._addresses.get(peer) or peer == self.node_id:
            return
        old = self._channels.get(peer)
        if old is not None:
            self._retire(old)  # to an address the peer has left
        log.info("coordinator %s: node %s is at %s (running node set)", self.node_id, peer, address)
        channel = self._links.aio_channel(address, options=self._options)
        self._addresses[peer] = address
        self._channels[peer] = channel
        self._peers[peer] = coordinator_pb2_grpc.CoordinatorStub(channel)
        self._inflight.setdefault(peer, 0)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        """Closes a replaced channel in the background: kept open until the node stops,
        each change of a peer's address left one more behind."""
        closing = asyncio.ensure_future(channel.close(None))
        self._closing_tasks.add(closing)
        closing.add_done_callback(self._closing_tasks.discard)

    def _sent(self, peer: str) -> None:
        self._inflight[peer] -= 1

    async def _deliver_to(self, peer: str, message: coordinator_pb2.PeerMessage) -> None:
        try:
            await self._peers[peer].Deliver(message, timeout=self._timeout_s)
            self._tls_refused.discard(peer)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and handshake_failure(exc.details()):
                # A peer that is up but whose certificate does not check out (wrong CA,
                # wrong name) never joins: say so once, not on every probe.
                if peer not in self._tls_refused:
                    self._tls_refused.add(peer)
                    log.warning(
                        "coordinator %s: TLS handshake with %s failed (its certificate is "
                        "not from the cluster CA or does not name %s, or it refused ours): %s",
                        self.node_id,
                        peer,
                        peer,
                        exc.details(),
                    )
            elif exc.code() != grpc.StatusCode.UNAVAILABLE and exc.code() != (
                grpc.StatusCode.DEADLINE_EXCEEDED
            ):
                log.info(
                    "coordinator %s: %s refused %s: %s",
                    self.node_id,
                    peer,
                    message.WhichOneof("body"),
                    exc.details(),
                )
            else:
                self._lost(peer, message.WhichOneof("body") or "", exc)

    def _lost(self, peer: str, kind: str, exc: grpc.aio.AioRpcError) -> None:
        """Says that a message the election waits on did not reach ``peer`` (chaos seed
        101: a merge waited member_timeout_ms for an accept that never arrived, and
        nothing in the logs said whether it was sent)."""
        if kind not in _SAID_WHEN_LOST:
            return
        now = self._clock.monotonic_ms()
        last = self._lost_logged.get((peer, kind))
        if last is not None and now - last < _LOST_LOG_INTERVAL_MS:
            return
        self._lost_logged[(peer, kind)] = now
        log.info(
            "coordinator %s: %s to %s not delivered: %s: %s (the protocol tolerates the "
            "loss; whoever waited for it goes on at its timeout)",
            self.node_id,
            kind,
            peer,
            exc.code().name,
            exc.details(),
        )

    async def close(self) -> None:
        """Closes every channel."""
        for channel in self._channels.values():
            await channel.close(None)
        if self._closing_tasks:
            await asyncio.gather(*self._closing_tasks, return_exceptions=True)


class GrpcReplicaLink:
    """The replica link over gRPC: ReplicaControl.SetRole and the health service."""

    def __init__(self, config: ClusterConfig, node: NodeConfig) -> None:
        self.config = config
        # The running node set (set by CoordinatorNode): role commands carry its addresses.
        self.running_set: Callable[[], Membership | None] | None = None
        options = [
            *channel_options(config.limits.max_message_bytes),
            *reconnect_options(config.timeouts.heartbeat_interval_ms),
        ]
        self._channel = transport(config, node.id).aio_channel(
            node.replica_address, options=options
        )
        self.control = replica_pb2_grpc.ReplicaControlStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._rpc_timeout_s = config.timeouts.rpc_timeout_ms / 1000
        self._lease_ms = config.timeouts.member_timeout_ms

    async def set_role(self, command: RoleCommand, reason: str) -> ReplicaAnswer | ReplicaFailure:
        """SetRole; a gRPC error becomes a ReplicaFailure."""
        try:
            answer = await self.control.SetRole(
                self._role_proto(command, reason), timeout=self._rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return replica_failure(exc.code(), exc.details() or "")
        return replica_answer(command, answer.state)

    async def check_health(self) -> bool:
        """Any answer, even NOT_SERVING or an error status, means the replica is alive."""
        try:
            await self._health.Check(
                health_pb2.HealthCheckRequest(),
                timeout=self.config.timeouts.replica_timeout_ms / 1000,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _NO_ANSWER:
                return False
        return True

    async def prepare_handoff(
        self, request: replica_pb2.PrepareHandoffRequest, timeout_s: float
    ) -> replica_pb2.PrepareHandoffResponse:
        """PrepareHandoff; a gRPC error becomes a HandoffError naming its status."""
        try:
            return await self.control.PrepareHandoff(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise handoff.HandoffError(exc.code().name, exc.details() or "") from None

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close(None)

    def _role_proto(self, command: RoleCommand, reason: str) -> replica_pb2.RoleCommand:
        running = self.running_set() if self.running_set is not None else None
        return role_proto(self.config, running, command, reason, self._lease_ms)


def role_proto(
    config: ClusterConfig,
    running: Membership | None,
    command: RoleCommand,
    reason: str,
    lease_ms: int,
) -> replica_pb2.RoleCommand:
    """The SetRole request for ``command``: endpoints from the running node set."""
    known = {n.id for n in config.nodes} | set(running.ids if running else ())

    def endpoint_of(node_id: str) -> common_pb2.NodeEndpoint:
        return running_endpoint(config, running, node_id)

    message = replica_pb2.RoleCommand(
        role=_ROLES[command.kind],
        epoch=command.epoch,
        sync_source_id=command.sync_source_id,
        reason=reason,
        seq=command.seq,
        lease_ms=lease_ms,
        cluster_id=command.cluster_id,
    )
    if command.master_id:
        message.master.CopyFrom(endpoint_of(command.master_id))
    message.members.extend(endpoint_of(m) for m in command.members if m in known)
    message.voting_nodes.extend(endpoint_of(m) for m in command.nodes if m in known)
    message.learner_nodes.extend(endpoint_of(m) for m in command.learners if m in known)
    return message


def running_endpoint(
    config: ClusterConfig, running: Membership | None, node_id: str
) -> common_pb2.NodeEndpoint:
    """A node's addresses and priority from the running node set (a membership change),
    else from the config file."""
    member = running.member(node_id) if running is not None and running.version else None
    if member is None:
        return endpoint(config, node_id)
    return common_pb2.NodeEndpoint(
        node_id=member.node_id,
        replica_address=member.replica_address,
        coordinator_address=member.coordinator_address,
        priority=member.priority,
    )


def endpoint(config: ClusterConfig, node_id: str) -> common_pb2.NodeEndpoint:
    """A node's addresses and priority, as messages carry them."""
    n = config.node(node_id)
    return common_pb2.NodeEndpoint(
        node_id=n.id,
        replica_address=n.replica_address,
        coordinator_address=n.coordinator_address,
        priority=n.priority,
    )


class CoordinatorNode:
    """One node's coordinator: runs the CoordinatorDriver on asyncio (see the docstring)."""

    def __init__(
        self,
        config: ClusterConfig,
        node: NodeConfig,
        clock: Clock | None = None,
        *,
        on_shutdown: Callable[[], None] | None = None,
        observability: Telemetry | None = None,
        peers: PeerTransport | None = None,
        replica: ReplicaLink | None = None,
        store: StateStore | None = None,
        running_nodes: RunningNodes | None = None,
    ) -> None:
        self.config = config
        # The node ids the server's call guards accept: the election's node set in force.
        self.running_nodes = running_nodes or RunningNodes(
            (n.id for n in config.nodes), (g.id for g in config.gateways)
        )
        self.node = node
        self.clock = clock or SystemClock()
        observed = observability or current()
        # State and election counters (squall_server.coordinator.telemetry); None while off.
        self._observer = CoordinatorObserver(observed, node.id) if observed.metering else None
        self.state_path: Path = node.data_dir / STATE_FILE_NAME
        self._peers = peers if peers is not None else GrpcPeers(config, node.id)
        self._replica: ReplicaLink = (
            replica if replica is not None else GrpcReplicaLink(config, node)
        )
        self._wakeup = asyncio.Event()
        self._role_changed = asyncio.Event()
        self.driver = CoordinatorDriver(
            election_config(config, node.id),
            driver_timings(config),
            self.clock,
            self._peers,
            store if store is not None else FileStateStore(self.state_path),
            self._group_id,
            self._cluster_id,
            wake=self._wakeup.set,
            role_changed=self._role_changed.set,
            view_changed=self._view_changed,
            hand_over=self._start_hand_over,
            transfer_dropped=self._drop_hand_over,
            save_failed=self._state_not_saved,
            every_member_acks=config.durability.acks == common_pb2.ACK_POLICY_ALL,
        )
        if isinstance(self._peers, GrpcPeers):
            self._peers.address_of = self._coordinator_address
        if isinstance(self._replica, GrpcReplicaLink):
            self._replica.running_set = lambda: self.election.membership
        self._follow_running_set()
        # Stops the process (a clean cluster shutdown asked for it).
        self._on_shutdown = on_shutdown
        self._probe: asyncio.Task[None] | None = None
        # A hand-over the election asked for (a member that joined to catch up caught up).
        self._hand_over: asyncio.Task[None] | None = None
        # Lifting the write fence of a transfer the election gave up.
        self._fence_lift: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Queue[coordinator_pb2.GroupView]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._failed = ""
        # Set by ``quiesce``: the process is stopping; the election neither sends nor takes.
        self._stopping = False
        self._renew_s = config.timeouts.heartbeat_interval_ms / 1000

    def _coordinator_address(self, node_id: str) -> str:
        """Where the running node set says ``node_id``'s coordinator is ("" if unknown)."""
        membership = self.election.membership
        member = membership.member(node_id) if membership.version else None
        return member.coordinator_address if member is not None else ""

    @staticmethod
    def _group_id() -> str:
        return uuid.uuid4().hex[:16]

    @staticmethod
    def _cluster_id() -> str:
        return new_cluster_id()

    @property
    def election(self) -> Election:
        """The driver's current Election (a recovery replaces it)."""
        return self.driver.election

    @property
    def shutting_down(self) -> str:
        """The cluster shutdown this coordinator stops for (empty: none)."""
        return self.driver.shutting_down

    @property
    def failed(self) -> str:
        """Why this coordinator fail-stopped ("" while it runs)."""
        return self._failed

    def _fail_stop(self, reason: str) -> None:
        """The process stops (exit status 1, so a service manager starts it again), the
        replica's role lapsing with it: its state could not be saved (the driver's hook),
        or one of its loops ended (``_loop_ended``). Either way, running on would leave a
        coordinator that answers calls but no longer elects."""
        if self._failed:
            return
        self._failed = reason
        log.error(
            "coordinator %s FAIL-STOP: %s; it stops (exit status 1) rather than run on: "
            "start it again once the cause is fixed",
            self.node.id,
            reason,
        )
        if self._on_shutdown is not None:
            self._on_shutdown()

    def _state_not_saved(self, reason: str) -> None:
        self._fail_stop(f"{reason} (if the disk is full: docs/operations.md, 'A full disk')")

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """A loop runs until cancelled: one that ended otherwise failed."""
        if task.cancelled() or self.shutting_down or self._stopping:
            return
        exc = task.exception()
        if isinstance(exc, StateSaveError):
            return  # the driver's hook said so already
        self._fail_stop(f"its {task.get_name()} loop ended: {exc!r}")

    def shutdown(self, shutdown_id: str, operator: str) -> None:
        """Clean cluster shutdown: stop electing and exit (the replica keeps its state)."""
        log.warning(
            "coordinator %s stopping for cluster shutdown %s (asked by %s): epoch=%d",
            self.node.id,
            shutdown_id or "-",
            operator,
            self.election.persisted.epoch,
        )
        self.driver.shutting_down = shutdown_id or "-"
        for task in self._tasks:
            task.cancel()
        if self._on_shutdown is not None:
            self._on_shutdown()

    # --- lifecycle

    async def start(self) -> None:
        """Starts the tick loop, the role loop and the replica watch."""
        persisted = self.election.persisted
        log.info(
            "coordinator %s starting: epoch=%d max_seen=%d designated_primary=%s "
            "quorum_override=%d",
            self.node.id,
            persisted.epoch,
            persisted.max_seen,
            persisted.designated_primary,
            persisted.quorum_override,
        )
        if self._observer is not None:
            self._observer.instruments.watch(self)
            self._observer.changed(self.election.status())
        self._tasks = [
            asyncio.create_task(self._tick_loop(), name="tick"),
            asyncio.create_task(self._role_loop(), name="role"),
            asyncio.create_task(self._replica_watch_loop(), name="replica-watch"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._loop_ended)

    def quiesce(self) -> None:
        """Stops electing at once, before the process's server drains its calls (up to a
        second): from then on this coordinator sends nothing and takes no message, as a
        killed one, and its replica's role lease is no longer renewed. Left electing
        while its server took no more answers, it lost its group within
        member_timeout_ms, formed one of its own and probed the master's coordinator,
        which merged it back and waited member_timeout_ms for an accept that never came,
        with no master meanwhile (chaos seed 87: 1 s without a master after a slave's
        SIGTERM). Before it goes silent it tells its group that it leaves
        (``Election.stopping``): its coordinator drops it, or its members elect, at once
        rather than after member_timeout_ms, and nobody hands it the group meanwhile."""
        if self._tasks and not (self._stopping or self.shutting_down or self._failed):
            try:
                self.driver.stopping(f"the coordinator of node {self.node.id} is stopping")
            except Exception:  # stopping goes on: the group then notices the silence
                log.exception("coordinator %s: telling its group it stops failed", self.node.id)
        self._stopping = True
        for task in (*self._tasks, self._probe, self._hand_over, self._fence_lift):
            if task is not None:
                task.cancel()

    async def stop(self) -> None:
        """Stops the loops and closes channels."""
        if self._observer is not None:
            self._observer.instruments.unwatch(self)
        tasks = [
            *self._tasks,
            *(
                task
                for task in (self._probe, self._hand_over, self._fence_lift)
                if task is not None
            ),
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                continue  # a loop that failed: its fail-stop said why
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._replica.close()
        close = getattr(self._peers, "close", None)
        if close is not None:
            await close()

    # --- inputs

    async def _tick_loop(self) -> None:
        while True:
            wait_ms = self.driver.tick()
            self._wakeup.clear()
            # asyncio.timeout, not wait_for: no task per wait (this loop runs every tick).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_ms / 1000):
                    await self._wakeup.wait()

    def deliver(self, message: coordinator_pb2.PeerMessage) -> Rejection | None:
        """Steps one peer message; returns the rejection if it was refused (no change)."""
        if self.shutting_down or self._stopping:
            return None  # stopping (for a cluster shutdown): as if the message were lost
        try:
            decoded = codec.from_proto(message)
        except ValueError as exc:
            log.warning("coordinator %s: malformed message refused: %s", self.node.id, exc)
            raise
        if isinstance(self._peers, GrpcPeers):
            self._peers.heard_from(decoded.from_node)
        ready = self.driver.deliver(decoded)
        return None if ready is None else ready.rejection

    def apply(self, ready: Ready) -> None:
        """Applies a Ready record (see CoordinatorDriver.apply)."""
        self.driver.apply(ready)

    def set_designated_primary(self, enabled: bool, operator: str) -> Ready:
        """Operator control: see Election.set_designated_primary."""
        return self.driver.set_designated_primary(enabled, operator)

    def set_quorum_override(self, required: int, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.set_quorum_override."""
        return self.driver.set_quorum_override(required, operator, reason)

    def set_quarantine(self, enabled: bool, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.set_quarantine."""
        return self.driver.set_quarantine(enabled, operator, reason)

    def ack_loss(self, loss_id: str, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.ack_loss."""
        return self.driver.ack_loss(loss_id, operator, reason)

    def change_membership(self, change: MembershipChange, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.change_membership."""
        return self.driver.change_membership(change, operator, reason)

    async def transfer_leadership(
        self, target: str, operator: str, reason: str, timeout_ms: int
    ) -> Ready:
        """Operator control: hand the master role to ``target`` (see handoff.py)."""
        return await handoff.transfer(self, self._replica, target, operator, reason, timeout_ms)

    def _start_hand_over(self, target: str) -> None:
        """The election's ``Ready.hand_over_to``: run the transfer in the background (one
        at a time; the election asks again later if this one fails)."""
        if self._hand_over is not None and not self._hand_over.done():
            return
        self._hand_over = asyncio.create_task(self._run_hand_over(target), name="hand-over")

    def _drop_hand_over(self, target: str) -> None:
        """The election's ``Ready.transfer_dropped``: the target left before taking over, so
        the transfer's wait stops and the replica lifts its write fence now, not at the
        fence's deadline (chaos seed 97: 2.1 s without an acknowledgement after the group
        was handed to a member that had just been stopped)."""
        if self._stopping or self.shutting_down:
            return
        if self._hand_over is not None and not self._hand_over.done():
            self._hand_over.cancel()
        epoch = self.election.status().epoch
        rpc_timeout_ms = self.config.timeouts.rpc_timeout_ms
        self._fence_lift = asyncio.create_task(
            handoff.resume(self._replica, epoch, target, rpc_timeout_ms), name="fence-lift"
        )

    async def _run_hand_over(self, target: str) -> None:
        """Hand the group to a member that rejoined to catch up and has (handoff.py)."""
        reason = f"{target} ranks above this node and has caught up after rejoining"
        try:
            ready = await self.transfer_leadership(target, "auto", reason, 0)
        except handoff.HandoffError as exc:
            log.warning("coordinator %s: hand-over to %s failed: %s", self.node.id, target, exc)
            return
        if ready.rejection is not None:
            log.info(
                "coordinator %s: hand-over to %s not started: %s",
                self.node.id,
                target,
                ready.rejection.message,
            )

    def status(self) -> ElectionStatus:
        """The election's status."""
        return self.election.status()

    # --- the replica

    async def _role_loop(self) -> None:
        """Applies the newest role command to the replica, renewing it as a lease."""
        while True:
            command = self.driver.role_wanted()
            if command is None:
                await self._role_changed.wait()
                self._role_changed.clear()
                continue
            started_ms = self.clock.monotonic_ms()
            outcome = await self._replica.set_role(
                command, self.election.status().last_change_reason
            )
            took_ms = self.clock.monotonic_ms() - started_ms
            if self.driver.role_outcome(command, outcome, took_ms) is RoleNext.AGAIN:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._renew_s):
                    await self._role_changed.wait()
            self._role_changed.clear()

    async def _replica_watch_loop(self) -> None:
        """Asks the driver whether the replica is quiet; probes its health if so."""
        while True:
            await asyncio.sleep(self.driver.watch_interval_ms / 1000)
            if self.driver.watch() and (self._probe is None or self._probe.done()):
                self._probe = asyncio.create_task(self._probe_replica(), name="replica-probe")

    async def _probe_replica(self) -> None:
        """One health check of the replica; any answer means it is alive."""
        if await self._replica.check_health():
            self.driver.replica_answered()

    # --- the group view

    def group_view(self) -> coordinator_pb2.GroupView:
        """This node's view of its group, as gateways watch it."""
        status = self.election.status()
        running = status.membership
        known = {n.id for n in self.config.nodes} | set(running.ids if running else ())
        view = coordinator_pb2.GroupView(
            node_id=self.node.id,
            state=codec.status_to_proto(status).state,
            epoch=status.epoch,
            group_name=status.group_name,
            members=[
                running_endpoint(self.config, running, m) for m in status.members if m in known
            ],
        )
        if status.state is NodeState.NORMAL and status.coordinator_id in known:
            view.master.CopyFrom(running_endpoint(self.config, running, status.coordinator_id))
        if running is not None and running.version:
            view.nodes.extend(running_endpoint(self.config, running, m) for m in running.ids)
            view.membership_version = running.version
            view.membership_epoch = running.epoch
        return view

    def _follow_running_set(self) -> None:
        """The call guards take the node set in force (a membership change moved it)."""
        membership = self.election.membership
        if not membership.version:
            return
        added, removed = self.running_nodes.follow(membership.ids)
        if added or removed:
            log.info(
                "coordinator %s: call guards follow node set %s: %s added, %s removed",
                self.node.id,
                membership.describe(),
                ",".join(sorted(added)) or "none",
                ",".join(sorted(removed)) or "none",
            )

    def _view_changed(self) -> None:
        self._follow_running_set()
        view = self.group_view()
        for queue in self._watchers:
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(view)
        if self._observer is not None:
            self._observer.changed(self.election.status())

    async def watch(self) -> AsyncIterator[coordinator_pb2.GroupView]:
        """The current view, then every change, until the caller stops iterating."""
        queue: asyncio.Queue[coordinator_pb2.GroupView] = asyncio.Queue(_WATCH_QUEUE_MAX)
        self._watchers.add(queue)
        try:
            yield self.group_view()
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)
