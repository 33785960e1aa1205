"""The coordinator's driver: the real clock, disk and network around the pure Election.

It feeds the election its inputs (ticks at `next_deadline_ms()`, peer messages, the local
replica's reports, operator controls) and applies each `Ready` record in the order the
record documents: persist, send, command the replica, publish the view, log. Everything
runs on one asyncio loop, so inputs are applied one at a time and in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.clock import Clock, SystemClock
from services.common.config import ClusterConfig, NodeConfig
from services.common.grpc_server import channel_options
from services.common.ids import new_cluster_id
from services.common.telemetry import Telemetry, current
from services.common.tls import handshake_failure, transport
from services.coordinator import codec, handoff
from services.coordinator.election import Election, ElectionConfig
from services.coordinator.messages import (
    ElectionStatus,
    LogLevel,
    NodeState,
    PeerMessage,
    Ready,
    Rejection,
    ReplicaReport,
    RoleCommand,
    RoleCommandKind,
    StoreState,
)
from services.coordinator.persist import STATE_FILE_NAME, load_state, save_state
from services.coordinator.telemetry import CoordinatorObserver
from squall.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)

log = logging.getLogger("squall.coordinator")

_LEVELS = {
    LogLevel.DEBUG: logging.DEBUG,
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
}
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
# A replica's reorganization progress is logged at most this often.
_SYNC_LOG_INTERVAL_MS = 1000
# One fate per node: the replica counts as quiet once this many heartbeat intervals pass
# without an answer (a role renewal is answered about once per interval); the driver then
# probes its health and tells the election since when it has been silent. The election
# decides (after timeouts.replica_timeout_ms) that the node leaves its group.
_QUIET_HEARTBEATS = 1.5
# How often the watch looks at the replica's last answer, in heartbeat intervals.
_WATCH_HEARTBEATS = 0.5
# Role-call failures that may mean the replica did not answer at all (a dead or hung
# process); any other status is an answer from a live replica.
_NO_ANSWER = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# Reconnect quickly to a peer that restarts: failover time depends on it.
_FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


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
    )


class CoordinatorNode:
    """One node's coordinator: drives the Election with real time, disk and network."""

    def __init__(
        self,
        config: ClusterConfig,
        node: NodeConfig,
        clock: Clock | None = None,
        *,
        on_shutdown: Callable[[], None] | None = None,
        observability: Telemetry | None = None,
    ) -> None:
        self.config = config
        self.node = node
        self.clock = clock or SystemClock()
        observed = observability or current()
        # State and election counters (services.coordinator.telemetry); None while off.
        self._observer = CoordinatorObserver(observed, node.id) if observed.metering else None
        self.state_path: Path = node.data_dir / STATE_FILE_NAME
        self.election = Election(
            election_config(config, node.id),
            load_state(self.state_path),
            self._group_id,
            self._cluster_id,
            wall_offset_ms=self._wall_offset_ms(),
        )
        # Stops the process (a clean cluster shutdown asked for it).
        self._on_shutdown = on_shutdown
        self.shutting_down = ""
        # The last report handed to the election, to notice a replica that restarted (or
        # whose store an operator changed) while it was inactive.
        self._last_report: ReplicaReport | None = None
        options = [*channel_options(config.limits.max_message_bytes), *_FAST_RECONNECT]
        links = transport(config, node.id)
        self._channels = {
            n.id: links.aio_channel(n.coordinator_address, options=options)
            for n in config.nodes
            if n.id != node.id
        }
        self._peers = {
            peer: coordinator_pb2_grpc.CoordinatorStub(channel)
            for peer, channel in self._channels.items()
        }
        self._replica_channel = links.aio_channel(node.replica_address, options=options)
        self._replica = replica_pb2_grpc.ReplicaControlStub(self._replica_channel)
        self._replica_health = health_pb2_grpc.HealthStub(self._replica_channel)
        # One fate per node: when the replica last answered any call (monotonic ms; the
        # start counts, so a replica starting after its coordinator has its grace), whether
        # the election has been told it is silent, and the health probe in flight.
        self._replica_seen_ms = self.clock.monotonic_ms()
        self._silence_reported = False
        # Since when the replica's store has not completed a write, as its last answer to a
        # role call said, once that passed timeouts.store_stall_timeout_ms (None: it
        # writes). A stalled replica still answers, but counts as silent until it writes.
        self._store_stalled_since_ms: int | None = None
        self._probe: asyncio.Task[None] | None = None
        self._inflight = {peer: 0 for peer in self._peers}
        self._tls_refused: set[str] = set()  # peers whose TLS handshake failed (logged once)
        self._wakeup = asyncio.Event()
        self._role_wanted: RoleCommand | None = None
        self._role_changed = asyncio.Event()
        self._watchers: set[asyncio.Queue[coordinator_pb2.GroupView]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._rpc_timeout_s = config.timeouts.rpc_timeout_ms / 1000
        # The replica drops its role if the coordinator stops renewing it for this long.
        self._lease_ms = config.timeouts.member_timeout_ms
        self._renew_s = config.timeouts.heartbeat_interval_ms / 1000
        self._sync_noted_ms = 0

    @staticmethod
    def _group_id() -> str:
        return uuid.uuid4().hex[:16]

    @staticmethod
    def _cluster_id() -> str:
        return new_cluster_id()

    def shutdown(self, shutdown_id: str, operator: str) -> None:
        """Clean cluster shutdown: stop electing and exit (the replica keeps its state)."""
        log.warning(
            "coordinator %s stopping for cluster shutdown %s (asked by %s): epoch=%d",
            self.node.id,
            shutdown_id or "-",
            operator,
            self.election.persisted.epoch,
        )
        self.shutting_down = shutdown_id or "-"
        for task in self._tasks:
            task.cancel()
        if self._on_shutdown is not None:
            self._on_shutdown()
    def _wall_offset_ms(self) -> int:
        """Turns the election's monotonic time into wall-clock time for operator records."""
        return self.clock.wall_ms() - self.clock.monotonic_ms()

    # --- lifecycle

    async def start(self) -> None:
        """Starts the tick loop and the role applier."""
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

    async def stop(self) -> None:
        """Stops the loops and closes channels."""
        if self._observer is not None:
            self._observer.instruments.unwatch(self)
        tasks = [*self._tasks, *([self._probe] if self._probe is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for channel in [self._replica_channel, *self._channels.values()]:
            await channel.close(None)

    # --- inputs

    def _now(self) -> int:
        return self.clock.monotonic_ms()

    async def _tick_loop(self) -> None:
        while True:
            self.apply(self.election.tick(self._now()))
            deadline = self.election.next_deadline_ms()
            wait_ms = self.config.timeouts.heartbeat_interval_ms
            if deadline is not None:
                wait_ms = max(1, min(wait_ms, deadline - self._now()))
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait_ms / 1000)

    def deliver(self, message: coordinator_pb2.PeerMessage) -> Rejection | None:
        """Steps one peer message; returns the rejection if it was refused (no change)."""
        if self.shutting_down:
            return None  # stopping for a cluster shutdown: as if the message were lost
        try:
            decoded = codec.from_proto(message)
        except ValueError as exc:
            log.warning("coordinator %s: malformed message refused: %s", self.node.id, exc)
            raise
        ready = self.election.step(decoded, self._now())
        self.apply(ready)
        return ready.rejection

    def set_designated_primary(self, enabled: bool, operator: str) -> Ready:
        """Operator control: see Election.set_designated_primary."""
        ready = self.election.set_designated_primary(enabled, operator, self._now())
        self.apply(ready)
        return ready

    def set_quorum_override(self, required: int, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.set_quorum_override."""
        ready = self.election.set_quorum_override(required, operator, self._now(), reason)
        self.apply(ready)
        return ready

    def set_quarantine(self, enabled: bool, operator: str, reason: str = "") -> Ready:
        """Operator control: see Election.set_quarantine."""
        ready = self.election.set_quarantine(enabled, operator, self._now(), reason)
        self.apply(ready)
        return ready

    async def transfer_leadership(
        self, target: str, operator: str, reason: str, timeout_ms: int
    ) -> Ready:
        """Operator control: hand the master role to ``target`` (see handoff.py)."""
        return await handoff.transfer(self, self._replica, target, operator, reason, timeout_ms)

    def _note_fault(self, state: replica_pb2.ReplicaState) -> None:
        """A fault the replica reports quarantines this node (once per fault)."""
        if state.fault_id:
            self.apply(
                self.election.replica_fault(state.fault_id, state.fault_reason, self._now())
            )

    def status(self) -> ElectionStatus:
        """The election's status."""
        return self.election.status()

    # --- applying a Ready, in the documented order

    def apply(self, ready: Ready) -> None:
        """Persist, send, command the replica, publish the view, log."""
        if ready.persist is not None:
            save_state(self.state_path, ready.persist)
        for message in ready.messages:
            self._send(message)
        if ready.role_command is not None:
            self._role_wanted = ready.role_command
            self._role_changed.set()
        if ready.view_changed:
            self._publish_view()
            if self._observer is not None:
                self._observer.changed(self.election.status())
        for event in ready.events:
            log.log(_LEVELS[event.level], "%s [%s]", event.message, event.event)
        if ready.messages or ready.role_command:
            self._wakeup.set()  # the next deadline may have moved earlier

    def _send(self, message: PeerMessage) -> None:
        peer = message.to_node
        if peer not in self._peers or self._inflight[peer] >= _PEER_INFLIGHT_MAX:
            return
        self._inflight[peer] += 1
        task = asyncio.ensure_future(self._deliver_to(peer, codec.to_proto(message)))
        task.add_done_callback(lambda _: self._sent(peer))

    def _sent(self, peer: str) -> None:
        self._inflight[peer] -= 1

    async def _deliver_to(self, peer: str, message: coordinator_pb2.PeerMessage) -> None:
        try:
            await self._peers[peer].Deliver(message, timeout=self._lease_ms / 1000)
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
                        self.node.id,
                        peer,
                        peer,
                        exc.details(),
                    )
            elif exc.code() != grpc.StatusCode.UNAVAILABLE and exc.code() != (
                grpc.StatusCode.DEADLINE_EXCEEDED
            ):
                log.info(
                    "coordinator %s: %s refused %s: %s",
                    self.node.id,
                    peer,
                    message.WhichOneof("body"),
                    exc.details(),
                )

    # --- the replica

    async def _role_loop(self) -> None:
        """Applies the newest role command to the replica, renewing it as a lease."""
        applied: RoleCommand | None = None
        # The command whose failure was last logged: a replica that is down fails every
        # renewal, and once per command says it (the election logs how long it is down).
        warned: RoleCommand | None = None
        while True:
            command = self._role_wanted
            if command is None:
                await self._role_changed.wait()
                self._role_changed.clear()
                continue
            try:
                state = await self._replica.SetRole(
                    self._role_proto(command), timeout=self._rpc_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _NO_ANSWER:
                    self._replica_answered()
                if (
                    exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                    and command.kind is not RoleCommandKind.DEACTIVATE
                ):
                    self._recover(f"replica refused {command.kind.value}: {exc.details()}")
                    applied = None
                    continue
                if command is not applied and command is not warned:
                    warned = command
                    log.warning(
                        "coordinator %s: replica did not take %s (epoch=%d): %s: %s",
                        self.node.id,
                        command.kind.value,
                        command.epoch,
                        exc.code().name,
                        exc.details(),
                    )
                await self._pause_role_loop()
                continue
            self._replica_answered(state.state.store_stalled_ms)
            self._note_fault(state.state)
            if state.state.HasField("reorganization"):
                self._note_sync(state.state.reorganization)
            if command.kind is RoleCommandKind.DEACTIVATE:
                report = self._report(state.state, command.seq)
                if command is not applied:
                    # The replica has stopped: its log no longer grows, so this report may
                    # name a sync source or answer an invitation.
                    self._last_report = report
                    self.apply(self.election.replica_report(report, self._now()))
                elif self._last_report is not None and _changed(self._last_report, report):
                    # Only a restart (or an operator's offline change, e.g. `squall store
                    # mark-clean`) changes an inactive replica: what this node told its
                    # group is stale, so it recovers and is merged again with a new report.
                    self._recover(
                        f"replica state changed while inactive: {_summary(self._last_report)}"
                        f" -> {_summary(report)}"
                    )
                    applied = None
                    continue
            applied = command
            await self._pause_role_loop()

    # --- one fate per node: is the replica answering?

    def _replica_answered(self, store_stalled_ms: int | None = None) -> None:
        """The replica answered a call: note it; a silence the election knows of is over,
        unless the replica's store is stalled (a stuck disk).

        store_stalled_ms: how long its store's oldest write has run, from an answer that
        says (a role call's); None from one that does not (a health probe), which leaves a
        known stall as it is."""
        now = self._now()
        self._replica_seen_ms = now
        if store_stalled_ms is not None:
            self._note_store_stall(store_stalled_ms, now)
        if self._store_stalled_since_ms is not None:
            return
        if self._silence_reported:
            self._silence_reported = False
            self.apply(self.election.replica_answered(now))

    def _note_store_stall(self, stalled_ms: int, now: int) -> None:
        """A store stalled past store_stall_timeout_ms is reported as a silent replica
        (since the stall began); a store that writes again ends it."""
        if stalled_ms <= self.config.timeouts.store_stall_timeout_ms:
            if self._store_stalled_since_ms is not None:
                log.warning(
                    "coordinator %s: replica store writes again after a %d ms stall",
                    self.node.id,
                    now - self._store_stalled_since_ms,
                )
            self._store_stalled_since_ms = None
            return
        if self._store_stalled_since_ms is not None:
            return
        since = max(0, now - stalled_ms)
        self._store_stalled_since_ms = since
        log.warning(
            "coordinator %s: replica store stalled: its oldest write has run %d ms "
            "(store_stall_timeout_ms %d); the node leaves its group until writes complete",
            self.node.id,
            stalled_ms,
            self.config.timeouts.store_stall_timeout_ms,
        )
        self._silence_reported = True
        self.apply(self.election.replica_silent(since, now, store_stalled=True))

    async def _replica_watch_loop(self) -> None:
        """Tells the election when the replica has gone quiet (it decides what that means),
        probing the replica's health meanwhile: a role call can be slow for a live replica
        (a deactivation waits for a write in progress), a health check is not."""
        heartbeat_ms = self.config.timeouts.heartbeat_interval_ms
        quiet_ms = heartbeat_ms * _QUIET_HEARTBEATS
        while True:
            await asyncio.sleep(heartbeat_ms * _WATCH_HEARTBEATS / 1000)
            if self.shutting_down:
                continue
            now = self._now()
            if now - self._replica_seen_ms <= quiet_ms:
                continue
            if self._probe is None or self._probe.done():
                self._probe = asyncio.create_task(self._probe_replica(), name="replica-probe")
            if not self._silence_reported:
                self._silence_reported = True
                self.apply(self.election.replica_silent(self._replica_seen_ms, now))

    async def _probe_replica(self) -> None:
        """One health check of the replica; any answer means it is alive."""
        try:
            await self._replica_health.Check(
                health_pb2.HealthCheckRequest(),
                timeout=self.config.timeouts.replica_timeout_ms / 1000,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _NO_ANSWER:
                return
        self._replica_answered()

    def _note_sync(self, progress: replica_pb2.ReorganizationProgress) -> None:
        """The replica answered a master role before taking it: its reorganization sync
        outlives the call and goes on; each renewal asks again. Logged every few seconds."""
        now = self._now()
        if now < self._sync_noted_ms:
            return
        self._sync_noted_ms = now + _SYNC_LOG_INTERVAL_MS
        log.info(
            "coordinator %s: replica still syncing for epoch %d: %s from %s, %d entries, "
            "snapshot at LSN %d: %d chunks, %d records, %d ms (attempt %d)",
            self.node.id,
            progress.epoch,
            progress.phase,
            progress.sync_source_id,
            progress.entries_fetched,
            progress.snapshot_lsn,
            progress.snapshot_chunks,
            progress.snapshot_records,
            progress.elapsed_ms,
            progress.attempt,
        )

    def _recover(self, reason: str) -> None:
        """Any error sends the node back to a group of its own (IceStorm's recovery)."""
        log.warning(
            "coordinator %s: %s; recovering as a group of its own (epoch=%d)",
            self.node.id,
            reason,
            self.election.persisted.epoch,
        )
        self.election = Election(
            election_config(self.config, self.node.id),
            self.election.persisted,
            self._group_id,
            self._cluster_id,
            wall_offset_ms=self._wall_offset_ms(),
        )
        self._role_wanted = None
        # The new machine has not heard of a silence yet: the watch tells it again.
        self._silence_reported = False
        self.apply(self.election.tick(self._now()))

    async def _pause_role_loop(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._role_changed.wait(), self._renew_s)
        self._role_changed.clear()

    def _endpoint(self, node_id: str) -> common_pb2.NodeEndpoint:
        n = self.config.node(node_id)
        return common_pb2.NodeEndpoint(
            node_id=n.id,
            replica_address=n.replica_address,
            coordinator_address=n.coordinator_address,
            priority=n.priority,
        )

    def _role_proto(self, command: RoleCommand) -> replica_pb2.RoleCommand:
        known = {n.id for n in self.config.nodes}
        message = replica_pb2.RoleCommand(
            role=_ROLES[command.kind],
            epoch=command.epoch,
            sync_source_id=command.sync_source_id,
            reason=self.election.status().last_change_reason,
            seq=command.seq,
            lease_ms=self._lease_ms,
            cluster_id=command.cluster_id,
        )
        if command.master_id:
            message.master.CopyFrom(self._endpoint(command.master_id))
        message.members.extend(self._endpoint(m) for m in command.members if m in known)
        return message

    def _report(self, state: replica_pb2.ReplicaState, seq: int) -> ReplicaReport:
        return ReplicaReport(
            cluster_id=state.cluster_id,
            last_epoch=state.last_epoch,
            last_lsn=state.last_lsn,
            store_state=_STORE_STATES.get(state.store_state, StoreState.EMPTY),
            active=state.role != common_pb2.ROLE_INACTIVE,
            command_seq=seq,
            shutdown_id=state.shutdown_id,
            joined=state.joined,
        )

    # --- the group view

    def group_view(self) -> coordinator_pb2.GroupView:
        """This node's view of its group, as gateways watch it."""
        status = self.election.status()
        known = {n.id for n in self.config.nodes}
        view = coordinator_pb2.GroupView(
            node_id=self.node.id,
            state=codec.status_to_proto(status).state,
            epoch=status.epoch,
            group_name=status.group_name,
            members=[self._endpoint(m) for m in status.members if m in known],
        )
        if status.state is NodeState.NORMAL and status.coordinator_id in known:
            view.master.CopyFrom(self._endpoint(status.coordinator_id))
        return view

    def _publish_view(self) -> None:
        view = self.group_view()
        for queue in self._watchers:
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(view)

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


def _changed(before: ReplicaReport, after: ReplicaReport) -> bool:
    """Did the replica's data or lifecycle change (not merely its command sequence)?"""
    return _summary(before) != _summary(after)


def _summary(report: ReplicaReport) -> str:
    """A report's data in one phrase, for the log."""
    shutdown = f" {report.shutdown_id}" if report.shutdown_id else ""
    return (
        f"cluster {report.cluster_id or '-'}, store {report.store_state.value}{shutdown}, "
        f"log {report.last_epoch}/{report.last_lsn}, joined={str(report.joined).lower()}"
    )
