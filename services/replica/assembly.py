"""Builds one node's replica: the pure core, its driver and the asyncio shells around them,
wired to each other, and the ``ReplicaNode`` adapter over them (``build_replica_node``).

The service (``__main__``), the tests and the simulators (``tests/sim/shell_sim.py``) all
build a replica here, so they run the same wiring. Each shell is given the narrow state it
uses (the driver and core, the commit lock, the store thread, the clock, a fault
callback), never the node; the one exception is the master's work (push delivery, topic
links), which reads and writes through the node and is attached to it when it is made
(``MasterWork``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

from squall.v1 import common_pb2
from squall_server.common.clock import Clock, SystemClock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.telemetry import Telemetry, current
from squall_server.replica import telemetry
from squall_server.replica.committed import reopen_gate
from squall_server.replica.core import CoreConfig, LogPosition, ReplicaCore, Role
from squall_server.replica.driver import ReplicaDriver
from squall_server.replica.faults import FaultReports
from squall_server.replica.follower import FollowerConfig
from squall_server.replica.master_driver import MasterDriver
from squall_server.replica.master_tasks import MasterWork
from squall_server.replica.node import ReplicaNode
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.reorg import answer_wait_s
from squall_server.replica.replication import SyncPolicy
from squall_server.replica.roles import NodeState, RoleApplication, RoleChanges, RolePersistence
from squall_server.replica.signals import CommitSignal
from squall_server.replica.slave_side import SlaveSide
from squall_server.replica.store import Store
from squall_server.replica.store.stall import StallMeter
from squall_server.replica.sync_source import SyncSource
from squall_server.replica.taking_master import TakingMaster
from squall_server.replica.transient import TransientTopics
from squall_server.replica.transport import GrpcReplicaTransport, ReplicaTransport
from squall_server.replica.truncation import Truncation
from squall_server.replica.visibility import CommitGate
from squall_server.replica.writer import Writer


def build_replica_node(
    config: ClusterConfig,
    node: NodeConfig,
    store: Store,
    clock: Clock | None = None,
    *,
    truncator: LmdbTruncator | None = None,
    observability: Telemetry | None = None,
    transport: Callable[[], ReplicaTransport] | None = None,
    io: concurrent.futures.Executor | None = None,
    running_nodes: RunningNodes | None = None,
) -> ReplicaNode:
    """One node's replica over ``store``, not started (``ReplicaNode.start``).

    ``clock``: the system clock unless given (the simulators give a virtual one).
    ``truncator`` truncates a divergent log suffix; None: the store cannot (the memory
    twin), a divergent slave gets a snapshot instead. ``observability``: the spans and
    metrics the service installed (``common.telemetry.current`` unless given).
    ``transport`` makes the connections to the other replicas: one per master epoch and
    one per reorganization sync, each closed when done (gRPC unless given). ``io`` runs
    the store's writes one at a time (a store thread unless given; the simulators' runs
    them on their virtual loop, ``tests/sim/virtual_loop.py``). ``running_nodes``: the
    node ids the server's call guards accept; the role commands' running node set moves
    them (so an added node is taken at once)."""
    clock = clock or SystemClock()
    # The configuration in force and the master's replication (roles.py replaces them).
    state = NodeState.of(config)
    running_nodes = running_nodes or RunningNodes(
        (n.id for n in config.nodes), (g.id for g in config.gateways)
    )
    # (The running node set may move a node's address: a transport is made from the
    # configuration in force when it is needed.)
    new_transport: Callable[[], ReplicaTransport] = transport or (
        lambda: GrpcReplicaTransport(state.config, node.id)
    )
    # Times the store's writes so a stuck disk is reported to the coordinator; moves with
    # the store when a truncation installs a new one.
    stall = StallMeter(clock)
    store.stall_meter = stall
    # Spans and metrics (telemetry.py); off unless a service installed it.
    observability = observability or current()
    instruments = telemetry.instruments(observability) if observability.metering else None
    # The newest traced publishes, for delivery spans to link to (telemetry.py).
    published_traces = telemetry.PublishedTraces()
    # The role rules (role, epoch and its floor, lease, shutdown freeze, hand-off fence,
    # the write gate) and the log's position and commit-LSN record live in the pure core.
    meta = store.meta()
    core = ReplicaCore(
        CoreConfig(
            node.id,
            {n.id: n.replica_address for n in config.nodes},
            config.limits.log_retention_entries,
        ),
        stored_epoch=meta.epoch,
        log=LogPosition(meta.last_lsn, store.log_start_lsn()),
    )
    # Set (and replaced) whenever a role command was applied or the role was lost.
    role_changes = RoleChanges(node.id, core, instruments)
    # A fault that makes this node unfit to serve; reported to the coordinator, which
    # quarantines the node (faults.py).
    faults = FaultReports(node.id, node.data_dir, clock, lambda: (core.epoch, core.log.last_lsn))
    transient = TransientTopics(config.limits.subscribe_batch_max_events * 10)
    committed = CommitSignal()
    io = io or concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=f"store-{node.id}"
    )
    # Held while a batch, a truncation, an install or a role's store write runs, so a
    # deactivation can wait for it and then report a log that no longer grows.
    commit_lock = asyncio.Lock()
    # Committed reads: what a subscriber may see. The store records the commit LSN this
    # node knew; what it holds above it stays hidden (ReplicaNode.start tracks it) until
    # a master's commit LSN passes it. A store that never recorded one (written before
    # the record existed) counts as committed throughout.
    gate = CommitGate(meta.last_lsn if meta.commit_lsn is None else meta.commit_lsn)
    core.log_reset(core.log.last_lsn, core.log.log_start_lsn, gate.commit_lsn)
    # Applies the core's slave-side effects to the store and the gate (both its own).
    driver = ReplicaDriver(
        node.id,
        core,
        store,
        gate,
        follower_config=FollowerConfig(
            node_id=node.id,
            sync_policy=SyncPolicy(int(config.durability.replica_sync)),
            inflight_entries_max=config.limits.replication_inflight_entries_max,
            inflight_bytes_max=config.limits.replication_inflight_bytes_max,
        ),
        on_committed=committed.notify,
        on_role_changed=role_changes.changed_now,
        on_fault=faults.report,
        local_commits=config.durability.acks == common_pb2.ACK_POLICY_NONE,
    )
    # A store that cannot write must not acknowledge anything again (the driver's).
    fail_stop = driver.fail_stop
    # Truncation of a divergent suffix and the loss reports it leaves (truncation.py).
    truncation = Truncation(
        node.id,
        node.data_dir,
        core,
        driver,
        truncator,
        stall=stall,
        io=io,
        commit_lock=commit_lock,
        clock=clock,
        published_traces=published_traces,
        instruments=instruments,
        fail_stop=fail_stop,
    )
    # The write queue, group commit and compaction (writer.py).
    writer = Writer(
        node,
        lambda: state.config,
        core,
        driver,
        lambda: state.master,
        clock=clock,
        io=io,
        commit_lock=commit_lock,
        observability=observability,
        report_fault=faults.report,
        fail_stop=fail_stop,
    )
    # Answers a new master's reorganization fetch (sync_source.py).
    sync_source = SyncSource(
        node.id,
        driver,
        lambda: state.config,
        is_master=lambda: core.role == Role.MASTER,
        io=io,
        commit_lock=commit_lock,
        clock=clock,
    )
    # What a slave does with its master's stream (slave_side.py).
    slave = SlaveSide(
        node.id,
        core,
        driver,
        io=io,
        commit_lock=commit_lock,
        append=writer.append_entries,
        compact=writer.compact,
        truncate_locked=truncation.truncate_locked,
        fail_stop=fail_stop,
    )
    # A role's flushed store writes (its epoch, the DIRTY mark), on the store thread.
    persistence = RolePersistence(
        node.id, core, io=io, commit_lock=commit_lock, fail_stop=fail_stop
    )
    # Push delivery and topic links: they run while master, from the epoch start's
    # commit; the node attaches them.
    master_work = MasterWork()

    def set_master(master: MasterDriver) -> None:
        state.master = master

    def master_deposed(reason: str) -> None:
        # The replication core deposed this master: no more writes in this epoch.
        master_work.stop()
        state.master = None
        writer.wake()
        driver.deposed(reason)

    # Taking the master role: the reorganization fetch, the epoch start (taking_master.py).
    taking = TakingMaster(
        node,
        lambda: state.config,
        lambda: state.nodes,
        core,
        driver,
        transport=lambda: new_transport(),
        clock=clock,
        io=io,
        commit_lock=commit_lock,
        observability=observability,
        truncate_by_snapshot=truncator is None,
        persist_role=persistence.persist,
        submit=writer.submit,
        install_snapshot_chunk=slave.install_snapshot_chunk,
        truncate_after=truncation.truncate_after,
        gate_from_store=lambda why: reopen_gate(driver.store, node.id, why),
        new_epoch=transient.new_epoch,
        set_master=set_master,
        on_deposed=master_deposed,
        on_epoch_started=master_work.start,
        report_fault=faults.report,
    )
    # Role commands and the core's role effects (roles.py). (The master's replication for
    # its epoch is ``state.master``; a slave's follower and the number of its current
    # stream are the core's: ``core.follower``, ``core.stream_seq``.)
    roles = RoleApplication(
        node,
        core,
        driver,
        state,
        clock=clock,
        commit_lock=commit_lock,
        writer=writer,
        taking=taking,
        persistence=persistence,
        changes=role_changes,
        running_nodes=running_nodes,
        stop_delivery=master_work.stop,
        answer_wait_s=answer_wait_s(
            config.timeouts.heartbeat_interval_ms, config.timeouts.rpc_timeout_ms
        ),
    )
    return ReplicaNode(
        node=node,
        clock=clock,
        state=state,
        running_nodes=running_nodes,
        core=core,
        driver=driver,
        telemetry=observability,
        instruments=instruments,
        published_traces=published_traces,
        transient=transient,
        faults=faults,
        committed=committed,
        stall=stall,
        io=io,
        commit_lock=commit_lock,
        writer=writer,
        truncation=truncation,
        sync_source=sync_source,
        slave=slave,
        taking=taking,
        roles=roles,
        master_work=master_work,
    )
