"""Role application: carries out the coordinator's role commands and the pure core's
role effects for one replica node (taking, following, dropping a role, the membership a
command brings, the lease watch), given the narrow state it uses rather than the node.

Every role rule is decided by ``ReplicaCore`` (``core.py``); ``RoleApplication`` feeds it
the commands and ticks and does, in the order ``Effects`` documents (the driver's
``role_steps``), each step the driver leaves to the asyncio shell. ``NodeState`` holds what
a role command may replace while the node runs (the configuration in force, its nodes,
the master's replication of its epoch), shared by the node and its shells;
``RoleChanges`` wakes whoever waits for a role change; ``RolePersistence`` runs a role's
flushed store write on the store thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.common.running_nodes import RunningNodes
from squall_server.replica import telemetry
from squall_server.replica.core import (
    Effects,
    Follow,
    PersistRole,
    ReplicaCore,
    Role,
    RoleOrder,
    StoreFacts,
)
from squall_server.replica.driver import (
    CancelTaking,
    DropRole,
    FollowMaster,
    JoinTaking,
    RecordClusterId,
    RenewMembers,
    ReplicaDriver,
    StartTaking,
)
from squall_server.replica.master_driver import MasterDriver
from squall_server.replica.reorg import Taking
from squall_server.replica.replication import ReplicationError
from squall_server.replica.store import StoreError, StoreFullError
from squall_server.replica.taking_master import TakingMaster
from squall_server.replica.writer import Writer

T = TypeVar("T")
log = logging.getLogger("squall.replica")

# How often the lease watch asks the core whether the role lease ran out: a small part of
# the shortest lease a coordinator gives (its member timeout).
LEASE_CHECK_S = 0.05


@dataclasses.dataclass
class NodeState:
    """What a role command or a role change replaces while the node runs: the
    configuration in force (a membership change's running node set replaces the config
    file's nodes), its nodes by id, and the master's replication of its epoch (None
    unless this node is master)."""

    config: ClusterConfig
    nodes: dict[str, NodeConfig]
    master: MasterDriver | None = None

    @classmethod
    def of(cls, config: ClusterConfig) -> NodeState:
        """The state at start-up: the config file's nodes, no master's replication."""
        return cls(config, {n.id: n for n in config.nodes})


class RoleChanges:
    """The role-changed signal: counted in the role-change metric and set (then replaced)
    whenever a role command was applied or the role was lost."""

    def __init__(
        self,
        node_id: str,
        core: ReplicaCore,
        instruments: telemetry.ReplicaInstruments | None,
    ) -> None:
        self._node_id = node_id
        self._core = core
        self._instruments = instruments
        self._counted_role = Role.INACTIVE  # the role the role-change metric last saw
        self._changed = asyncio.Event()

    def changed_now(self) -> None:
        """Counts a role change and wakes whoever waits for one."""
        role = self._core.role
        if role != self._counted_role and self._instruments is not None:
            name = telemetry.ROLE_NAMES.get(common_pb2.Role.ValueType(int(role)), role.name)
            self._instruments.role_changes.add(1, {"node": self._node_id, "role": name})
        self._counted_role = role
        self.notify()

    def notify(self) -> None:
        """Wakes whoever waits for a role change."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self) -> None:
        """Returns at the next role change."""
        await self._changed.wait()


class RolePersistence:
    """Runs a role's flushed store writes (the core's ``record_cluster_id`` and
    ``persist_role``: its cluster id, epoch and DIRTY mark) on the store thread,
    serialized with every other write under the commit lock."""

    def __init__(
        self,
        node_id: str,
        core: ReplicaCore,
        *,
        io: concurrent.futures.Executor,
        commit_lock: asyncio.Lock,
        fail_stop: Callable[[str], None],
    ) -> None:
        self._node_id = node_id
        self._core = core
        self._io = io
        self._commit_lock = commit_lock
        self._fail_stop = fail_stop

    async def persist(self, persist: Callable[[], T]) -> T:
        """Runs ``persist`` on the store thread. A flush also writes out every unsynced
        append before it (a slave's WRITE_NO_SYNC batches): on a busy disk that outlasts
        the coordinator's replica_timeout_ms, and the event loop must keep answering its
        role renewals and health probes meanwhile (issue 14).

        A store that cannot persist the role's epoch must not hold it (nor acknowledge
        anything again): the replica fail-stops and the command is refused, UNAVAILABLE
        naming the store's error (found by tests/sim/shell_sim.py: it escaped SetRole as
        an unexpected exception and left the role held on an unpersisted epoch)."""
        async with self._commit_lock:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._io, persist)
            except StoreFullError as exc:
                # Nothing was written and space may come back (as a full store refuses a
                # batch): the role is refused, the replica keeps serving what it can.
                raise ServiceError(
                    Code.RESOURCE_EXHAUSTED,
                    f"replica {self._node_id} could not persist its new role: store full "
                    f"({exc}); its store still at epoch {self._core.epoch}",
                ) from exc
            except StoreError as exc:
                epoch = self._core.epoch  # the one its store holds (the new one is not stored)
                self._fail_stop(f"store write failed persisting a new role: {exc}")
                raise ServiceError(
                    Code.UNAVAILABLE,
                    f"replica {self._node_id} could not persist its new role (store write "
                    f"failed: {exc}); it stopped serving, its store still at epoch {epoch}",
                ) from exc


async def _to_the_end(applying: asyncio.Future[Taking | None]) -> Taking | None:
    """Waits for a role command's application, which a cancelled caller (the SetRole call
    past its deadline) does not cut short: the core has decided it, and a drop stopped
    half-way (the core inactive, the old epoch's master still replicating) let the next
    master role run beside it (coordinated simulator, seed 526). The cancellation comes
    through once it is done, the role lock still held until then."""
    cancelled = False
    while not applying.done():  # bounded: each pass ends it or takes a cancellation
        try:
            await asyncio.shield(applying)
        except asyncio.CancelledError:
            if applying.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return applying.result()


class RoleApplication:
    """Applies role commands and the core's role effects, one command at a time."""

    def __init__(
        self,
        node: NodeConfig,
        core: ReplicaCore,
        driver: ReplicaDriver,
        state: NodeState,
        *,
        clock: Clock,
        commit_lock: asyncio.Lock,
        writer: Writer,
        taking: TakingMaster,
        persistence: RolePersistence,
        changes: RoleChanges,
        running_nodes: RunningNodes,
        stop_delivery: Callable[[], None],
        answer_wait_s: float,
    ) -> None:
        """``stop_delivery`` stops push delivery and topic links (they run while master);
        ``answer_wait_s``: how long a role command waits for a master role being taken
        before it answers with the reorganization's progress (``reorg.answer_wait_s``)."""
        self.node = node
        self.core = core
        self.driver = driver
        self.state = state
        self.clock = clock
        self._commit_lock = commit_lock
        self._writer = writer
        self._taking = taking
        self._persistence = persistence
        self._changes = changes
        self._running_nodes = running_nodes
        self._stop_delivery = stop_delivery
        self._answer_wait_s = answer_wait_s
        # Role commands are applied one at a time (a become_master may wait on a fetch).
        self._role_lock = asyncio.Lock()

    async def apply_role(self, command: replica_pb2.RoleCommand) -> None:
        """Takes (or renews) the role the coordinator commands, one command at a time.

        A master role is taken by a background task (its reorganization sync may take
        long, see ``reorg``): this waits for it at most a heartbeat interval; if it is
        still running, ``reorganization_progress`` says how far it got and the same
        command repeated joins it.
        """
        async with self._role_lock:
            applying = asyncio.ensure_future(self._apply_role(command))
            try:
                taking = await _to_the_end(applying)
            finally:
                self._changes.notify()
        if taking is None:
            return
        await asyncio.wait({taking.task}, timeout=self._answer_wait_s)
        if taking.task.done() and self._taking.current is taking:
            self._taking.observe()
            self._taking.current = None
            self.driver.taking_answer(taking.epoch)

    async def _apply_role(self, command: replica_pb2.RoleCommand) -> Taking | None:
        """Applies a role command as the core decides; returns the task taking a master
        role, if any."""
        await self._taking.wait_stopped()
        self._taking.observe()
        self._adopt_running_set(command)
        meta = self.driver.store.meta()
        order = RoleOrder(
            role=command.role,
            epoch=command.epoch,
            master_id=command.master.node_id,
            members=tuple(m.node_id for m in command.members),
            sync_source_id=command.sync_source_id,
            reason=command.reason,
            seq=command.seq,
            lease_ms=command.lease_ms,
            cluster_id=command.cluster_id,
        )
        effects = self.core.role_command(
            order, self.clock.monotonic_ms(), StoreFacts(meta.epoch, meta.cluster_id)
        )
        taking = self._taking.current
        if self.core.taking is None and taking is not None and taking.task.done():
            self._taking.current = None  # its outcome answered this command
        return await self.apply_effects(effects)

    async def apply_effects(self, effects: Effects) -> Taking | None:
        """Carries out what the core decided (the driver's ``role_steps``, in the order
        ``Effects`` documents), doing each step it leaves to this shell; returns the task
        taking (or already taking) a master role, if any."""
        taking: Taking | None = None
        for step in self.driver.role_steps(effects):
            match step:
                case CancelTaking(why):
                    await self._taking.cancel(why)
                case DropRole(reason, was_active):
                    await self._drop_role(reason, was_active=was_active)
                case StartTaking(take, persist):
                    taking = self._taking.start(take, persist)
                case RecordClusterId() | PersistRole():
                    try:
                        await self._persistence.persist(
                            functools.partial(self.driver.write_role, step)
                        )
                    except ServiceError as refusal:
                        if refusal.code == Code.RESOURCE_EXHAUSTED:
                            # No role on an epoch the store does not hold; the coordinator
                            # asks again, and the role is taken once the write fits.
                            await self.deactivate(refusal.message)
                        raise
                case FollowMaster(follow):
                    await self._become_slave(follow)
                case JoinTaking():
                    taking = self._taking.current
                case RenewMembers(members):
                    self._renew_members(list(members))
        return taking

    def _adopt_running_set(self, command: replica_pb2.RoleCommand) -> None:
        """A membership change made a running node set: take its nodes and addresses in
        place of the config file's, so the commit majority is counted from it and the
        master streams to the nodes it added (docs/operations.md, "Changing the
        membership")."""
        if not command.voting_nodes:
            return
        added, removed = self._running_nodes.follow(
            [e.node_id for e in (*command.voting_nodes, *command.learner_nodes)]
        )
        if added or removed:
            log.info(
                "replica %s: call guards follow the running node set: %s added, %s removed",
                self.node.id,
                ",".join(sorted(added)) or "none",
                ",".join(sorted(removed)) or "none",
            )
        known = self.state.nodes
        nodes = tuple(
            NodeConfig(
                e.node_id,
                e.priority,
                e.coordinator_address,
                e.replica_address,
                known[e.node_id].data_dir if e.node_id in known else self.node.data_dir,
                learner,
            )
            for entries, learner in ((command.voting_nodes, False), (command.learner_nodes, True))
            for e in entries
        )
        if nodes == self.state.config.nodes:
            return
        log.warning(
            "replica %s: running node set %s (was %s): commits count a majority of its voters",
            self.node.id,
            ",".join(n.id + (" (learner)" if n.learner else "") for n in nodes),
            ",".join(n.id + (" (learner)" if n.learner else "") for n in self.state.config.nodes),
        )
        self.state.config = dataclasses.replace(self.state.config, nodes=nodes)
        self.state.nodes = {n.id: n for n in nodes}
        self.core.config = dataclasses.replace(
            self.core.config, replica_addresses={n.id: n.replica_address for n in nodes}
        )

    def _renew_members(self, member_ids: list[str]) -> None:
        """A master renewal naming fewer members: the group shrank within the epoch."""
        driver = self.state.master
        if driver is None or set(member_ids) == set(driver.core.members):
            return
        try:
            driver.set_members(member_ids)
        except ReplicationError as exc:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"replica {self.node.id} (master, epoch {self.core.epoch}) cannot take "
                f"members {','.join(member_ids)}: {exc}",
            ) from exc
        log.info(
            "replica %s (master, epoch %d): group now %s",
            self.node.id,
            self.core.epoch,
            ",".join(member_ids),
        )

    async def _become_slave(self, follow: Follow) -> None:
        """Follows the master in its epoch (the core's ``Follow``, its epoch persisted
        first: ``Effects.persist_role``): the master's replication stream is accepted from now."""
        async with self._commit_lock:  # no batch half-applied while the follower is made
            self.driver.follow(follow, self.clock.monotonic_ms())
        log.info(
            "replica %s follows %s: epoch=%d lsn=%d reason=%s",
            self.node.id,
            follow.master_id,
            follow.epoch,
            self.core.log.last_lsn,
            follow.reason,
        )

    async def deactivate(self, reason: str) -> None:
        """Drops the role: stops serving writes and replication; returns once no write is
        in progress."""
        await self.apply_effects(self.core.drop_role(reason))

    async def _drop_role(self, reason: str, *, was_active: bool) -> None:
        """The core dropped the role (``Effects.drop_role``): stops the follower, fails the
        writes not begun, stops push delivery and the master's replication, and waits for
        the batch being written."""
        await self._taking.wait_stopped()
        self._writer.fail_queued(
            ServiceError(
                Code.UNAVAILABLE,
                f"replica {self.node.id} lost its role before the write began (not stored)",
            )
        )
        self._stop_delivery()
        async with self._commit_lock:
            pass
        driver, self.state.master = self.state.master, None
        if driver is not None:
            await driver.stop(f"replica {self.node.id} deactivated: {reason}")
        if was_active:
            log.info(
                "replica %s inactive: epoch=%d lsn=%d commit_lsn=%d reason=%s",
                self.node.id,
                self.core.epoch,
                self.core.log.last_lsn,
                self.driver.gate.commit_lsn,
                reason,
            )

    async def wait_for_role(self, unreachable: frozenset[str], timeout_s: float) -> None:
        """Waits (up to timeout_s) while this replica can neither serve a write nor name a
        master the caller can reach: no role, or a slave of a master in `unreachable`.

        A publisher proxy whose master just died otherwise bounces between this replica's
        redirect to the dead master and its own backoff; held here, its call goes on (served
        or redirected to the new master) the moment the coordinator's next role command
        lands, so the publisher's gap is the election's. A master named in an epoch newer
        than the one the wait began in was elected after the caller found it unreachable
        (its replica restarted, or the node took the lead back): the call goes to it.
        """
        held_in_epoch = self.core.epoch
        # Bounded by the timeout: each pass waits for a role change (the event loop keeps
        # the deadline, so no clock is read here).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not self.core.failed_reason and self.core.role != Role.MASTER:
                    master = self.state.nodes.get(self.core.master_id)
                    if (
                        self.core.role == Role.SLAVE
                        and master is not None
                        and (
                            master.replica_address not in unreachable
                            or self.core.epoch > held_in_epoch
                        )
                    ):
                        return
                    await self._changes.wait()

    async def watch_lease(self) -> None:
        """Ticks the core, which drops the role when the coordinator stops renewing it
        (e.g. it died)."""
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            # Under the role lock, as a role command: the drop sets the core inactive at
            # once but stops the master's replication only after its write in progress
            # (the commit lock); a master role taken in between would not drop the old
            # epoch's driver, which then ran on beside the new one (coordinated
            # simulator, seed 526: its late deposition dropped the new role).
            async with self._role_lock:
                effects = self.core.tick(self.clock.monotonic_ms())
                if effects.thawed:
                    log.warning("replica %s: %s", self.node.id, effects.thawed)
                if effects.drop_role:
                    await self.apply_effects(effects)
