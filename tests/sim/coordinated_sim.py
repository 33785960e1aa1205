"""Seeded simulator of three whole shipped nodes: each a ``CoordinatorNode`` and a
``ReplicaNode``, on one virtual-time loop, faults hitting each process alone.

``shell_sim.py``'s harness (virtual loop, ``ShellNetwork`` between the replicas,
``MemoryKV`` disks, clients, checks) with its role script replaced by the shipped
coordinator: per node a ``CoordinatorNode`` (``services/coordinator/node.py``: the tick,
role and watch loops around ``CoordinatorDriver`` and the pure ``Election``) runs as its
own simulated process (``n1.c1``, ``n1.c2`` ... beside the replica's ``n1.1``), with the
loop's clock, an in-memory state store that survives its crashes (``MemoryStateStore``),
group and cluster ids drawn from the seed, and two simulated links:

* ``SimPeers`` (its ``PeerTransport``): each peer message goes through the shipped codec
  (``codec.to_proto`` / ``CoordinatorNode.deliver``) after a seeded delay (so messages
  overtake each other), is lost with a seeded probability or when the link is cut (one
  way or both), is delivered twice with a seeded probability (a send retried after its
  answer was lost; each copy after its own delay), and runs in the receiving
  coordinator's process (held while it is paused, gone once it crashed).
* ``SimReplicaLink`` (its ``ReplicaLink``): a role command becomes the SetRole request
  the gRPC link sends (``node.role_proto``), is served by the replica's shipped servicer
  (``server.ReplicaControl.SetRole``) in the replica's process, and its answer or status
  becomes what the gRPC link returns (``node.replica_answer`` / ``replica_failure``); a
  health check is answered by the replica's process. The link can be cut on its own, one
  way or both (coordinator↔own-replica partition): a request lost on the way down, or an
  answer lost on the way up, ends as ``DEADLINE_EXCEEDED`` after ``rpc_timeout_ms``
  (half the requests sent into a cut are held, not lost: they reach the replica later,
  after newer ones maybe, and are served there); a replica that is down refuses the
  connection (``UNAVAILABLE``). A transfer's ``prepare_handoff`` goes the same way to
  ``ReplicaControl.PrepareHandoff`` (the fence on the master's writes, then the wait for
  the target), so the shipped hand-over (``handoff.transfer``) runs whole: an operator's
  transfer, and the hand-over to a higher-ranked node that rejoined and caught up.

Faults, besides ``shell_sim``'s replica faults (crash, restart, pause, replica link cuts
and resets, slow and failing disks): a coordinator crashes alone (restarted later from
its persisted state) or is stopped in order (SIGTERM, ``STOP_SHARE`` of those: quiesced
at once by the shipped ``CoordinatorNode.quiesce``, gone once its server drained),
pauses, has its peer links cut one way or both, or loses its link to its own replica; a
whole node crashes (both processes; where replicas flush every write, half of these are
machine crashes that lose what the store had not flushed) or is partitioned (both
networks). An operator asks the master's coordinator (the one normal as its group's
master in the highest epoch, as ``squall cluster transfer`` finds it) to transfer the
leadership to another node, or to give a node another priority (``set-priority``, a
membership change), through the shipped coordinator servicer. At the heal every link
heals, every process restarts or resumes, and the coordinators lift quarantines (an
operator's ``set_quarantine(False)`` after replacing a failing disk).

Snapshots as in ``shell_sim`` (half the seeds keep a short log, seeded chunk sizes;
installs begun and finished counted in ``Stats``): these stores truncate by rebuilding
(``MemoryTruncator``), so snapshots reach slaves mostly through compaction.

Clients publish to the replica that is master in the highest epoch. Checks as in
``shell_sim``: at most one master per epoch, a publish acknowledged within ``LIVENESS_S``
of the heal, every replica caught up, identical logs, every acknowledged event readable at
its receipt's offset. A failure raises ``ShellSimFailure`` ending with the replay command.

A whole-node crash is sometimes a machine gone for good (``REPLACE_SHARE``, one at a
time, never beside a rotted disk): nothing restarts it; the operator runs
``replace-node`` through the leading coordinator's servicer (asked again after a
refusal, and at the heal until done), then starts a new machine from the exported running
set, with an empty disk and no coordinator state: it joins as a learner, is brought up to
date and promoted, and the checks count it like the others.

The operator's ``squall cluster shutdown`` runs as the CLI runs it
(``cluster_shutdown.run_shutdown``) over ``SimShutdownCalls``, the shipped servicers in
each node's processes: among the faults (an operator draw; whatever it stopped, the heal
starts again), and in a quarter of the seeds on the healed cluster (asked again while no
single master serves), after which the clean stores must end at one point and every node
is started again: the cluster must serve, catch up and hold every acknowledged event.

A set-priority draw is sometimes a node taken out (``REMOVE_SHARE``): the operator runs
``remove-node`` through the leading coordinator's servicer (refused for the coordinator
itself, or when the rest could not form a majority); once done, stops the node's services
and wipes its machine, then runs ``add-node`` with new addresses (asked again until done,
and at the heal) and starts it from the exported running set like a replacing machine.
A removal the operator saw time out but done since is found at the heal in the leading
coordinator's running set, and finished the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import io
import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import grpc

from squall.v1 import common_pb2, coordinator_pb2, replica_pb2
from squall_server.cli.cluster_shutdown import (
    FINISH_HOLD_S,
    CallFailed,
    ShutdownError,
    run_shutdown,
)
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.coordinator import codec
from squall_server.coordinator import server as coordinator_server
from squall_server.coordinator.driver import (
    MemoryStateStore,
    ReplicaAnswer,
    ReplicaFailure,
)
from squall_server.coordinator.handoff import HandoffError
from squall_server.coordinator.membership import Membership
from squall_server.coordinator.messages import NodeState, PeerMessage, RoleCommand
from squall_server.coordinator.node import (
    CoordinatorNode,
    replica_answer,
    replica_failure,
    role_proto,
)
from squall_server.replica.faults import FAULT_FILE_NAME
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.server import ReplicaControl
from squall_server.replica.store import DATABASES, Store, StoreError
from squall_server.replica.store.kv_memory import MemoryKV
from tests.sim import shell_sim
from tests.sim.shell_sim import (
    NODE_IDS,
    Disk,
    Member,
    ProcessKV,
    ShellSim,
    ShellSimFailure,
    Stats,
)
from tests.sim.virtual_loop import Every

log = logging.getLogger("squall.sim.coordinated")
T = TypeVar("T")

# Fault kinds of this simulator, after shell_sim's ten.
_COORD_CRASH, _COORD_RESTART, _COORD_PAUSE, _COORD_CUT, _OWN_CUT = 10, 11, 12, 13, 14
_NODE_CRASH, _NODE_PARTITION, _COORD_HEAL, _TRANSFER, _SET_PRIORITY = 15, 16, 17, 18, 19
FAULT_KINDS = 20
# The share of coordinator crashes that are an orderly stop instead (SIGTERM: quiesced at
# once, the process gone once its server drained, as under systemd's restart).
STOP_SHARE = 0.3
FOLLOW_S = 0.02  # how often clients look up who is master (the gateways' view)
# Churn: the master epochs the clients see may number at most this many per disruption
# (a fault, a heal, an operator action) plus the slack. Seeds 0-299 under acks "all" saw
# at most 19 epochs (0.56 per disruption); a node whose replica refused every slave role
# made its group re-form about twenty times a second for as long as that lasted (seed
# 6623: 1,314 epochs for 27 disruptions, docs/status.md), which no safety check saw.
EPOCHS_PER_DISRUPTION_MAX = 2
EPOCHS_SLACK = 25
# The share of whole-node crashes whose machine is gone for good: the operator replaces
# the node (``squall cluster replace-node``), then starts a new, empty machine from the
# exported running set. One node at a time.
REPLACE_SHARE = 0.2
# The share of set-priority draws that are instead a node taken out of the cluster: the
# operator removes it (``squall cluster remove-node``), stops its services and wipes its
# machine, and later adds it back (``add-node``, new addresses, an empty store): the node
# set goes from three to two and back. One membership change of this kind at a time.
REMOVE_SHARE = 0.5
# How often the operator, asked to remove the leading node, picks another one instead (the
# rest are refused: the leader cannot be removed).
REMOVE_OTHER = 0.75
REPLACE_RETRY_S = 1.0  # the operator asks again this long after a refusal
REPLACE_WAIT_S = 10.0  # the CLI's --wait: until the change is done
OPERATOR_TIMEOUT_S = 5.0  # the CLI's call timeout
# The share of seeds that end with ``squall cluster shutdown`` of the healed cluster, every
# node started again after it (its own random stream: the fault schedule stays), and the
# share of operator draws in the fault phase that run a shutdown among the faults.
SHUTDOWN_SHARE = 0.25
SHUTDOWN_FAULT_SHARE = 0.3
SHUTDOWN_TIMEOUT_S = 30.0  # the command's --timeout
# The share of those shutdowns among the faults the operator stops midway: Ctrl-C (the
# command thaws what it froze) or, in half of them, its machine dies (nothing reaches the
# cluster any more; each freeze lapses after the hold the command asked for).
SHUTDOWN_INTERRUPT_SHARE = 0.4
# The share of requests to the own replica sent into a cut link that are held, not lost:
# they reach the replica after the coordinator gave up on them.
LATE_REQUEST = 0.5


def replay_command(seed: int) -> str:
    """The command that replays one seed."""
    return f"SEED={seed} .venv/bin/pytest -q -p no:cacheprovider tests/sim/test_coordinated_sim.py"


class _Aborted(Exception):
    """A servicer ended the call with a status (``context.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _ServicerContext:
    """The part of a gRPC servicer context that the servicers called here use."""

    def set_trailing_metadata(self, metadata: object) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Aborted(code, details)


@dataclasses.dataclass
class Coordinator:
    """One node's coordinator: its persisted state (outlives crashes) and incarnation."""

    node_id: str
    state: MemoryStateStore = dataclasses.field(default_factory=MemoryStateStore)
    incarnation: int = 0
    node: CoordinatorNode | None = None
    paused: bool = False
    # Asked to stop (SIGTERM): quiesced, its server refusing new calls while it drains the
    # ones it has, until the process exits (``CoordinatedSim._stop_coordinator``).
    stopping: bool = False
    # The config file it starts from (None: the simulator's; a replacing machine's is the
    # exported running set).
    config: ClusterConfig | None = None

    @property
    def process(self) -> str:
        return f"{self.node_id}.c{self.incarnation}"


class SimCoordinatorNode(CoordinatorNode):
    """The shipped shell with its group and cluster ids drawn from the seed (uuid4 would
    make a replay differ)."""

    def __init__(
        self,
        config: ClusterConfig,
        node: NodeConfig,
        clock: Clock,
        ids: random.Random,
        **links: object,
    ) -> None:
        self._ids = ids
        super().__init__(config, node, clock, **links)  # type: ignore[arg-type]

    def _group_id(self) -> str:  # type: ignore[override]
        return f"{self._ids.getrandbits(64):016x}"

    def _cluster_id(self) -> str:  # type: ignore[override]
        return f"{self._ids.getrandbits(128):032x}"


class SimPeers:
    """One coordinator's PeerTransport over the simulated coordinator network."""

    def __init__(self, sim: CoordinatedSim, node_id: str) -> None:
        self.sim = sim
        self.node_id = node_id

    def send(self, message: PeerMessage) -> None:
        sim = self.sim
        dst = message.to_node
        rng = sim.rng_net
        if (self.node_id, dst) in sim.coord_cuts or rng.random() < sim.loss:
            return
        proto = codec.to_proto(message)
        # A retried send (the first attempt's answer was lost) delivers it twice, each
        # copy after its own delay, so the copy may come first or after later messages.
        copies = 2 if sim.duplicate and rng.random() < sim.duplicate else 1
        for _ in range(copies):
            # Scheduled by the network, not the sender: a sender paused after sending
            # does not hold its message.
            sim.loop.call_later(
                rng.random() * sim.max_delay_s,
                sim.arrive,
                dst,
                proto,
                context=contextvars.Context(),
            )


class SimReplicaLink:
    """One coordinator's ReplicaLink: its own replica's servicer, over a cuttable link."""

    def __init__(self, sim: CoordinatedSim, member: Member) -> None:
        self.sim = sim
        self.member = member
        timeouts = sim.config.timeouts
        self.rpc_timeout_s = timeouts.rpc_timeout_ms / 1000
        self.health_timeout_s = timeouts.replica_timeout_ms / 1000
        self.lease_ms = timeouts.member_timeout_ms
        # The running node set (a set-priority changed it): role commands carry it.
        self.running_set: Callable[[], Membership | None] = lambda: None

    async def set_role(self, command: RoleCommand, reason: str) -> ReplicaAnswer | ReplicaFailure:
        config = self.member.config or self.sim.config
        request = role_proto(config, self.running_set(), command, reason, self.lease_ms)
        try:
            response = await self._call(
                lambda servicer: servicer.SetRole(request, _ServicerContext()),
                self.rpc_timeout_s,
            )
        except _Aborted as exc:
            return replica_failure(exc.code, exc.details)
        assert isinstance(response, replica_pb2.RoleCommandResponse)
        return replica_answer(command, response.state)

    async def prepare_handoff(
        self, request: replica_pb2.PrepareHandoffRequest, timeout_s: float
    ) -> replica_pb2.PrepareHandoffResponse:
        try:
            response = await self._call(
                lambda servicer: servicer.PrepareHandoff(request, _ServicerContext()), timeout_s
            )
        except _Aborted as exc:
            raise HandoffError(exc.code.name, exc.details) from None
        assert isinstance(response, replica_pb2.PrepareHandoffResponse)
        if not request.cancel:
            self.sim.stats.hand_offs += 1
        return response

    async def check_health(self) -> bool:
        try:
            await self._call(lambda servicer: _alive(), self.health_timeout_s)
        except _Aborted as exc:
            return exc.code not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        return True

    async def close(self) -> None:
        return None

    async def _call(self, serve: object, timeout_s: float) -> object:
        """One call to the replica as gRPC makes it: refused by a replica that is down,
        lost (a deadline) on a cut link either way, served in the replica's process."""
        sim, member = self.sim, self.member
        node_id = member.node_id
        await asyncio.sleep(sim.rng_net.random() * sim.max_delay_s)
        replica = member.replica
        if replica is None:
            raise _Aborted(grpc.StatusCode.UNAVAILABLE, f"replica {node_id} is down")
        process = member.process
        if (node_id, "down") in sim.own_cuts:
            if sim.rng_net.random() < LATE_REQUEST:
                late_s = timeout_s * (1 + sim.rng_net.random())
                sim.loop.call_later(late_s, self._late, serve, process, timeout_s)
            await asyncio.sleep(timeout_s)
            raise _Aborted(grpc.StatusCode.DEADLINE_EXCEEDED, "request lost (link cut)")
        assert callable(serve)
        call = sim.loop.spawn(process, serve(ReplicaControl(replica)))
        started = sim.loop.time()
        try:
            # Shielded: the caller must not wait for a killed or paused process to unwind
            # the call; the server learns of the deadline on its own (cancelled, unawaited).
            result = await asyncio.wait_for(asyncio.shield(call), timeout_s)
        except TimeoutError:
            _caller_gone(call)
            call.cancel()
            raise _Aborted(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time") from None
        except asyncio.CancelledError:
            # The caller was cancelled (a stopping coordinator's hand-over): gRPC cancels
            # the call, and what it ends with reaches nobody.
            _caller_gone(call)
            call.cancel()
            raise
        except _Aborted:
            raise
        except Exception as exc:
            if member.process != process:  # it crashed mid-call: the connection reset
                raise _Aborted(grpc.StatusCode.UNAVAILABLE, "replica crashed") from None
            raise _Aborted(grpc.StatusCode.UNKNOWN, f"servicer raised {exc!r}") from None
        if (node_id, "up") in sim.own_cuts or member.process != process:
            await asyncio.sleep(max(0.0, timeout_s - (sim.loop.time() - started)))
            raise _Aborted(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost (link cut)")
        return result

    def _late(self, serve: object, process: str, timeout_s: float) -> None:
        """A held request reaches the replica late (maybe after newer ones): served with
        the deadline it carries, counted from its arrival; nobody waits for the answer."""
        member = self.member
        replica = member.replica
        if replica is None or member.process != process:
            return  # its connection went with the process
        assert callable(serve)
        self.sim.note(f"late request reaches {process}")
        # The servicer's coroutine is made when the process runs the request: one killed
        # before that leaves none unawaited.
        call = self.sim.loop.spawn(process, _unanswered(lambda: serve(ReplicaControl(replica))))
        self.sim.loop.call_later(timeout_s, call.cancel)


def _caller_gone(call: asyncio.Task[object]) -> None:
    """The caller stopped waiting for ``call``: a refusal it ends with goes nowhere, as in
    ``_unanswered`` (coordinated seed 13519: a stopping coordinator's hand-over, cancelled
    while the replica's PrepareHandoff ran, left its FAILED_PRECONDITION unretrieved);
    anything else the servicer raises still reaches the loop and fails the seed."""

    def done(task: asyncio.Task[object]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, _Aborted):
            task.get_loop().call_exception_handler(
                {"message": "a call nobody waits for failed", "exception": exc, "task": task}
            )

    call.add_done_callback(done)


async def _alive() -> None:
    """A health check's answer: the replica's process ran it."""
    return None


async def _unanswered(call: Callable[[], Awaitable[object]]) -> None:
    """A call whose caller is gone: a refusal goes nowhere (anything else the servicer
    raises still reaches the loop and fails the seed)."""
    with contextlib.suppress(_Aborted):
        await call()


class SimShutdownCalls:
    """The operator's ``squall cluster shutdown`` calls (``ShutdownCalls`` of
    services/cli/cluster_shutdown.py), each served by the node's shipped servicer in its
    process after a network delay: a service that is down refuses the call (UNAVAILABLE),
    one paused or slow past the call's timeout fails it (DEADLINE_EXCEEDED)."""

    def __init__(self, sim: CoordinatedSim) -> None:
        self.sim = sim
        # The operator stops the command (``command``, its task) as it makes its first
        # call of this kind ("freeze", "poll": a state call after a freeze, "stop",
        # "finish"), and its machine dies with it when ``dies``: no call leaves any more.
        self.interrupt_at = ""
        self.dies = False
        self.dead = False
        self.command: asyncio.Task[object] | None = None
        self._froze = False

    def _step(self, kind: str) -> None:
        if kind != self.interrupt_at or self.command is None:
            return
        self.interrupt_at = ""
        self.sim.note(f"operator: {'machine dies' if self.dies else 'Ctrl-C'} at the {kind}")
        self.dead = self.dies
        self.command.cancel()  # lands at the call's first wait, as a signal would

    async def _served(self, process: str, serve: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        sim = self.sim
        await asyncio.sleep(sim.rng_net.random() * sim.max_delay_s)
        if self.dead:
            raise CallFailed("UNAVAILABLE: the operator's machine is down")
        call = sim.loop.spawn(process, _await(serve))
        await asyncio.wait({call}, timeout=timeout_s)
        if not call.done():
            call.cancel()
            raise CallFailed("DEADLINE_EXCEEDED: no answer in time")
        if call.cancelled():
            raise CallFailed("UNAVAILABLE: the process ended")
        exc = call.exception()
        if isinstance(exc, _Aborted):
            raise CallFailed(f"{exc.code.name}: {exc.details}")
        if exc is not None:
            sim.loop_errors.append(f"servicer raised {exc!r} to the shutdown command")
            raise CallFailed(f"UNKNOWN: {exc!r}")
        return call.result()

    async def _replica(
        self, node: NodeConfig, serve: Callable[[ReplicaControl], Awaitable[T]], timeout_s: float
    ) -> T:
        member = self.sim.members[node.id]
        replica = member.replica
        if replica is None:
            raise CallFailed(f"UNAVAILABLE: replica {node.id} is down")
        return await self._served(member.process, lambda: serve(ReplicaControl(replica)), timeout_s)

    async def _coordinator(
        self,
        node: NodeConfig,
        serve: Callable[[coordinator_server.Coordinator], Awaitable[T]],
    ) -> T:
        coordinator = self.sim.coordinators[node.id]
        running = coordinator.node
        if running is None:
            raise CallFailed(f"UNAVAILABLE: coordinator {node.id} is down")
        if coordinator.stopping:
            raise CallFailed(f"UNAVAILABLE: coordinator {node.id} is stopping")
        return await self._served(
            coordinator.process,
            lambda: serve(coordinator_server.Coordinator(running)),
            OPERATOR_TIMEOUT_S,
        )

    async def replica_state(self, node: NodeConfig) -> replica_pb2.ReplicaState:
        self._step("poll" if self._froze else "survey")
        return await self._replica(
            node,
            lambda s: s.GetReplicaState(replica_pb2.GetReplicaStateRequest(), _ServicerContext()),
            OPERATOR_TIMEOUT_S,
        )

    async def coordinator_status(self, node: NodeConfig) -> coordinator_pb2.CoordinatorStatus:
        return await self._coordinator(
            node, lambda s: s.GetStatus(coordinator_pb2.GetStatusRequest(), _ServicerContext())
        )

    async def freeze(
        self, node: NodeConfig, request: replica_pb2.FreezeForShutdownRequest, timeout_s: float
    ) -> replica_pb2.ReplicaState:
        self._froze = True
        self._step("freeze")
        return await self._replica(
            node, lambda s: s.FreezeForShutdown(request, _ServicerContext()), timeout_s
        )

    async def thaw(self, node: NodeConfig, request: replica_pb2.AbortShutdownRequest) -> None:
        await self._replica(
            node, lambda s: s.AbortShutdown(request, _ServicerContext()), OPERATOR_TIMEOUT_S
        )

    async def stop_coordinator(
        self, node: NodeConfig, request: coordinator_pb2.CoordinatorShutdownRequest
    ) -> None:
        self._step("stop")
        await self._coordinator(node, lambda s: s.Shutdown(request, _ServicerContext()))

    async def finish(
        self, node: NodeConfig, request: replica_pb2.FinishShutdownRequest
    ) -> replica_pb2.FinishShutdownResponse:
        self._step("finish")
        return await self._replica(
            node, lambda s: s.FinishShutdown(request, _ServicerContext()), OPERATOR_TIMEOUT_S
        )

    async def answering(self, kind: str, node: NodeConfig) -> bool:
        if kind == "replica":
            return self.sim.members[node.id].replica is not None
        coordinator = self.sim.coordinators[node.id]
        return coordinator.node is not None and not coordinator.stopping


async def _await(serve: Callable[[], Awaitable[T]]) -> T:
    """The servicer's coroutine, made when its process runs it (one killed before leaves
    none unawaited)."""
    return await serve()


class MemoryTruncator(LmdbTruncator):
    """The LMDB truncator's twin over a node's ``Disk``: its ``stage`` (a replay given up
    kept and resumed, as production does) rebuilds the log up to the kept LSN into a
    fresh ``MemoryKV`` instead of a staging directory, and ``swap`` puts it in at once
    (the rename); a crash before the swap leaves the old store. ``open_store`` opens the
    process's store over the swapped-in disk (the reopen)."""

    def __init__(self, member: Member, open_store: Callable[[ProcessKV], Store]) -> None:
        super().__init__(member.data_dir, map_size_bytes=0, dedupe_window=0)
        self.member = member
        self.open_store = open_store
        self._copy: MemoryKV | None = None  # the one being replayed into (or given up)
        self._staged: MemoryKV | None = None

    def _new_copy(self) -> Store:
        self._copy = MemoryKV(DATABASES, keep_unsynced=True)
        return Store(self._copy)

    def _drop_copy(self, copy: Store) -> None:
        self._copy = None

    def _finish_copy(self, copy: Store) -> Path:
        assert self._copy is not None
        self._copy.sync()
        self._staged, self._copy = self._copy, None
        return self.data_dir

    def swap(self, store: Store, staging: Path) -> Store:
        assert self._staged is not None and self.member.kv is not None
        if self.member.kv.dead:
            raise StoreError("the process is gone")
        self.member.disk.kv = self._staged
        self._staged = None
        return self.open_store(self.member.kv)

    def settle(self, staging: Path) -> None:
        return None

    def discard(self) -> None:
        super().discard()
        self._staged = None


class CoordinatedSim(ShellSim):
    """One seed's run of three whole nodes (``run``)."""

    fault_kinds = FAULT_KINDS

    def __init__(
        self,
        seed: int,
        root: Path,
        *,
        acks: common_pb2.AckPolicy.ValueType = common_pb2.ACK_POLICY_MAJORITY,
    ) -> None:
        super().__init__(seed, root, acks=acks)
        self.rng_net = random.Random(seed * 104729 + 1)
        self.rng_ids = random.Random(seed * 104729 + 2)
        # Its own stream: which coordinator crashes are orderly stops (and how long their
        # drain takes) leaves the rest of the seed's draws as they were.
        self.rng_stops = random.Random(seed * 104729 + 4)
        self.loss = self.rng.choice([0.0, 0.01, 0.05])
        self.max_delay_s = self.rng.choice([0.001, 0.005, 0.02])
        # Its own stream: the seed's fault schedule is the same with or without duplicates.
        self.duplicate = random.Random(seed * 104729 + 3).choice([0.0, 0.02, 0.1])
        self.coordinators = {n: Coordinator(n) for n in NODE_IDS}
        self.coord_cuts: set[tuple[str, str]] = set()
        # (node, "down"): requests to the replica are lost; (node, "up"): its answers are.
        self.own_cuts: set[tuple[str, str]] = set()
        self.master_epochs: set[int] = set()
        # The operator's node changes (remove, replace or add) run one at a time (the
        # fault phase's, the heal's).
        self._replacing = asyncio.Lock()
        # The gone node was removed by the operator (add it back), not lost (replace it).
        self.gone_removed = False
        self.removes_asked = 0
        # The replica addresses of the new machines asked for the gone node so far.
        self._asked: set[str] = set()
        self._machines = 0  # new machines' addresses
        self.shutting_down = False  # the operator's cluster shutdown runs

    def fail(self, what: str) -> ShellSimFailure:
        tail = "\n".join(self.stats.events[-40:])
        return ShellSimFailure(
            f"seed {self.seed}: {what}\n{self.setup()}\nlast events:\n{tail}\n"
            f"replay: {replay_command(self.seed)}"
        )

    def _truncator(self, member: Member) -> LmdbTruncator:
        return MemoryTruncator(member, self._store)

    # --- the coordinators

    def _start_roles(self) -> list[asyncio.Task[None] | Every]:
        for coordinator in self.coordinators.values():
            self._start_coordinator(coordinator)
        return [Every(self.loop, FOLLOW_S, self._follow_master, first_s=0)]

    def _start_coordinator(self, coordinator: Coordinator) -> None:
        coordinator.incarnation += 1
        coordinator.paused = coordinator.stopping = False
        link = SimReplicaLink(self, self.members[coordinator.node_id])
        config = coordinator.config or self.config
        node = SimCoordinatorNode(
            config,
            config.node(coordinator.node_id),
            self.clock,
            self.rng_ids,
            peers=SimPeers(self, coordinator.node_id),
            replica=link,
            store=coordinator.state,
            # A cluster shutdown stops the process (services/coordinator/__main__.py), after
            # the servicer's answer.
            on_shutdown=functools.partial(
                self.loop.call_soon,
                self._coordinator_exits,
                coordinator,
                coordinator.process,
                "after cluster shutdown",
            ),
        )
        link.running_set = lambda: node.election.membership
        coordinator.node = node
        self.loop.spawn(coordinator.process, node.start())
        self.note(f"start {coordinator.process}")

    def _coordinator_exits(self, coordinator: Coordinator, process: str, why: str) -> None:
        if coordinator.process == process and coordinator.node is not None:
            self.loop.kill(process)
            coordinator.node = None
            coordinator.paused = coordinator.stopping = False
            self.note(f"exit {why}: {process}")

    def _stop_coordinator(self, coordinator: Coordinator) -> None:
        """SIGTERM, as the shipped ``serve()`` takes it (services/coordinator/__main__.py):
        the node is quiesced at once, and the process exits once its server has drained
        the calls it had (up to a second); restarted as after a crash."""
        node = coordinator.node
        assert node is not None
        node.quiesce()
        coordinator.stopping = True
        self.stats.crashes += 1
        self.note(f"stop {coordinator.process} (SIGTERM)")
        self.loop.call_later(
            self.rng_stops.uniform(0.0, 1.0),
            self._coordinator_exits,
            coordinator,
            coordinator.process,
            "after SIGTERM",
        )

    def _crash_coordinator(self, coordinator: Coordinator) -> None:
        self.stats.crashes += 1
        self.loop.kill(coordinator.process)
        coordinator.node = None
        coordinator.paused = coordinator.stopping = False
        self.note(f"crash {coordinator.process}")

    def arrive(self, dst: str, message: coordinator_pb2.PeerMessage) -> None:
        """A peer message reaches dst's coordinator (if it runs): delivered in its process."""
        coordinator = self.coordinators[dst]
        node = coordinator.node
        if node is None:
            return
        self.loop.spawn(coordinator.process, _deliver(node, message))

    async def _heal_roles(self) -> None:
        self.coord_cuts.clear()
        self.own_cuts.clear()
        for coordinator in self.coordinators.values():
            if coordinator.node_id == self.gone:
                continue  # _finish_replacement brings its new machine up
            if coordinator.stopping:
                self._coordinator_exits(coordinator, coordinator.process, "at the heal")
            if coordinator.node is None:
                self._start_coordinator(coordinator)
            elif coordinator.paused:
                coordinator.paused = False
                self.loop.resume(coordinator.process)
            node = coordinator.node
            assert node is not None
            if coordinator.node_id in self.quarantined:
                # A rotted disk: out until it is replaced (ShellSim._replace_rotten_disks).
                node.set_quarantine(True, "sim-operator", "a log record failed its checksum")
            elif node.election.persisted.quarantine is not None:
                # The operator replaced the failing disk and lifts the quarantine.
                node.set_quarantine(False, "sim-operator", "disk replaced")
        await self._manual_recovery()
        await self._finish_replacement()

    def _unquarantine(self, node_id: str) -> None:
        super()._unquarantine(node_id)
        node = self.coordinators[node_id].node
        assert node is not None  # the heal started every coordinator
        node.set_quarantine(False, "sim-operator", "disk replaced")

    async def _manual_recovery(self) -> None:
        """After a total failure (every replica restarted since it last took a role, no
        store clean) the coordinators refuse a cold start, by design; the simulator does
        what docs/operations.md ("Manual recovery") tells an operator: stop the replica
        with the newest log, ``squall store mark-clean`` its store, start it again. Clean
        stores of two different shutdowns are refused too; the operator marks the stale
        ones dirty (``squall store mark-dirty``), as the refusal says. So is a dirty store
        whose log is newer than every clean one: the operator marks that one clean and
        the older clean ones dirty."""
        # Not a node the operator quarantined (a rotted disk, in no group), nor one whose
        # machine is gone, nor a new machine still a learner (its empty store is no
        # candidate: the coordinators weigh the voters' stores).
        out = {*self.quarantined, self.gone, *self._learners()}
        replicas = {m.node_id: m.replica for m in self.members.values() if m.node_id not in out}
        if any(r is None or r.joined for r in replicas.values()):
            return
        metas = {n: r.store.meta() for n, r in replicas.items() if r is not None}
        clean = {n: m for n, m in metas.items() if m.state == common_pb2.STORE_STATE_CLEAN}
        if len({meta.shutdown_id for meta in clean.values()}) > 1:
            # Clean stores of two shutdowns (some nodes were down for the first and not
            # started again before the second; seed 8920): the coordinators refuse, and
            # their message tells the operator to mark the stale ones dirty.
            newest = max(clean.values(), key=lambda meta: (meta.last_epoch, meta.last_lsn))
            for node_id, meta in clean.items():
                if meta.shutdown_id != newest.shutdown_id:
                    stale = self.members[node_id]
                    self._crash(stale, machine=False)
                    Store(stale.disk.kv).set_state(common_pb2.STORE_STATE_DIRTY)
                    self.note(f"clean stores of two shutdowns: operator marks {node_id}'s dirty")
                    await self._restart(stale)
            return
        best = max(metas, key=lambda n: (metas[n].last_epoch, metas[n].last_lsn))
        if clean:
            newest_clean = max((m.last_epoch, m.last_lsn) for m in clean.values())
            if newest_clean >= (metas[best].last_epoch, metas[best].last_lsn):
                return
            # A dirty store holds a newer log than every clean one (seed 29172: n2's replica,
            # restarted during a shutdown its coordinator missed, took roles past the
            # shutdown point): the coordinators refuse, and the operator recovers manually
            # from the newest log; the older clean stores then hold a stale shutdown id.
            for node_id in clean:
                stale = self.members[node_id]
                self._crash(stale, machine=False)
                Store(stale.disk.kv).set_state(common_pb2.STORE_STATE_DIRTY)
                self.note(f"newer log than the clean stores: operator marks {node_id}'s dirty")
                await self._restart(stale)
        member = self.members[best]
        self._crash(member, machine=False)
        store = Store(member.disk.kv)
        store.sync()
        store.set_state(common_pb2.STORE_STATE_CLEAN, f"sim-recovery-{self.seed}")
        self.note(f"manual recovery: operator marks {best}'s store clean")
        await self._restart(member)

    def _follow_master(self) -> None:
        """The clients' view, every FOLLOW_S: the replica that is master in the highest epoch."""
        best: tuple[int, str] | None = None
        for member in self.members.values():
            replica = member.replica
            if replica is not None and replica.role == common_pb2.ROLE_MASTER:
                if best is None or replica.epoch > best[0]:
                    best = (replica.epoch, member.node_id)
        if best is not None and best != (self.epoch, self.master_id):
            self.epoch, self.master_id = best
            if best[0] not in self.master_epochs:
                self.master_epochs.add(best[0])
                self.stats.elections += 1
            self.note(f"master {self.master_id} epoch {self.epoch}", observed=True)

    # --- faults

    async def _inject(self, member: Member, kind: int) -> None:
        if member.node_id == self.gone:
            return  # no machine to fault until the operator replaces it
        if kind < shell_sim_kinds():
            await super()._inject(member, kind)
            return
        rng = self.rng
        node_id = member.node_id
        coordinator = self.coordinators[node_id]
        others = [n for n in NODE_IDS if n != node_id]
        if kind == _COORD_CRASH and coordinator.node is not None:
            stoppable = not coordinator.paused and not coordinator.stopping
            if stoppable and self.rng_stops.random() < STOP_SHARE:
                self._stop_coordinator(coordinator)
            else:
                self._crash_coordinator(coordinator)
        elif kind == _COORD_RESTART and coordinator.node is None:
            self._start_coordinator(coordinator)
        elif kind == _COORD_PAUSE and coordinator.node is not None and not coordinator.paused:
            coordinator.paused = True
            self.loop.pause(coordinator.process)
            self.note(f"pause {coordinator.process}")
            self.loop.call_later(
                rng.uniform(0.1, 2.5), self._resume_coordinator, coordinator, coordinator.process
            )
        elif kind == _COORD_CUT:
            peer = rng.choice(others)
            self.coord_cuts.add((node_id, peer))
            both = rng.random() < 0.5
            if both:
                self.coord_cuts.add((peer, node_id))
            self.note(f"cut coordinator {node_id}->{peer}{' both ways' if both else ''}")
        elif kind == _OWN_CUT:
            ways = rng.choice([("down",), ("up",), ("down", "up")])
            self.own_cuts.update((node_id, way) for way in ways)
            self.note(f"cut {node_id}'s coordinator<->replica link {'/'.join(ways)}")
            self.loop.call_later(rng.uniform(0.2, 3.0), self._heal_own, node_id)
        elif kind == _NODE_CRASH:
            if coordinator.node is not None:
                self._crash_coordinator(coordinator)
            if member.replica is not None:
                # As for a replica alone: only where every acknowledged write was flushed
                # may half the crashes be machine crashes (what was not flushed is lost).
                machine = self.replica_sync == common_pb2.SYNC_POLICY_SYNC and rng.random() < 0.5
                self._crash(member, machine=machine)
            # A lost machine and a rotted copy elsewhere would be two failures. Before the
            # first group formed (which needs every node) there is no group to change.
            if (
                not self.gone
                and not self.rotten
                and self.master_epochs
                and not self._replacing.locked()
                and not self._named_learners()
                and rng.random() < REPLACE_SHARE
            ):
                self.gone = node_id
                self.note(f"{node_id}'s machine is gone for good")
                self.loop.call_later(rng.uniform(0.5, 2.0), self._operator_replaces)
            else:
                self.loop.call_later(rng.uniform(0.5, 3.0), self._restart_node, node_id)
        elif kind == _NODE_PARTITION:
            for peer in others:
                self.net.cut(node_id, peer, both=True)
                self.coord_cuts.update({(node_id, peer), (peer, node_id)})
            self.note(f"partition node {node_id}")
        elif kind == _COORD_HEAL:
            self.coord_cuts.clear()
            self.note("heal coordinator links")
        elif kind == _TRANSFER and not self.shutting_down and rng.random() < SHUTDOWN_FAULT_SHARE:
            self.shutting_down = True  # from now: the heal waits for it (_before_heal)
            self.loop.create_task(self._shutdown(self._interrupting()))  # the operator's
        elif kind == _SET_PRIORITY and rng.random() < REMOVE_SHARE:
            # Before the first group formed there is no group to change; a rotted copy
            # beside a node taken out would be two failures.
            if not self.gone and not self.rotten and self.master_epochs:
                self.loop.create_task(self._remove(node_id))  # the operator's machine
        elif kind in (_TRANSFER, _SET_PRIORITY):
            self._operator_control(node_id, kind)

    # --- operator controls

    def _leading(self) -> Coordinator | None:
        """The coordinator normal as its group's master in the highest epoch (whom the
        CLI's transfer and set-priority ask), if any runs."""
        best: tuple[int, Coordinator] | None = None
        for coordinator in self.coordinators.values():
            node = coordinator.node
            if node is None or coordinator.paused or coordinator.stopping:
                continue  # the CLI's status call to it would time out or be refused
            status = node.status()
            leads = status.state is NodeState.NORMAL and status.coordinator_id == node.node.id
            if leads and (best is None or status.epoch > best[0]):
                best = (status.epoch, coordinator)
        return None if best is None else best[1]

    def _operator_control(self, node_id: str, kind: int) -> None:
        """An operator's transfer to ``node_id`` (another node if it leads), or a new
        priority for it, asked of the leading coordinator through its servicer."""
        rng = self.rng
        coordinator = self._leading()
        if coordinator is None:
            self.note("operator: no master to ask")
            return
        node = coordinator.node
        assert node is not None
        master = node.node.id
        servicer = coordinator_server.Coordinator(node)
        call: Awaitable[object]
        if kind == _TRANSFER:
            others = [n for n in NODE_IDS if n != master]
            target = node_id if node_id != master else rng.choice(others)
            wait_ms = rng.choice([0, 1000, 5000])
            what = f"transfer {master}->{target} (wait {wait_ms} ms)"
            request = coordinator_pb2.TransferLeadershipRequest(
                target=target, operator="sim-operator", reason="sim", timeout_ms=wait_ms
            )
            call = servicer.TransferLeadership(request, _ServicerContext())
        else:
            priority = rng.randrange(5)
            what = f"set-priority {node_id} {priority} (asked of {master})"
            change = coordinator_pb2.ChangeMembershipRequest(
                kind=coordinator_pb2.MEMBERSHIP_CHANGE_KIND_SET_PRIORITY,
                node_id=node_id,
                priority=priority,
                operator="sim-operator",
                reason="sim",
            )
            call = servicer.ChangeMembership(change, _ServicerContext())
        self.note(f"operator: {what}")
        self.loop.spawn(coordinator.process, self._operator_call(what, call))

    async def _operator_call(self, what: str, call: Awaitable[object]) -> None:
        """One operator call, served in the coordinator's process; its outcome noted."""
        try:
            await call
        except _Aborted as exc:
            self.note(f"operator: {what} refused: {exc}")
            return
        self.note(f"operator: {what} done")

    # --- cluster shutdown (docs/operations.md, "Store lifecycle")

    def _interrupting(self) -> SimShutdownCalls:
        """The calls of a shutdown among the faults: in a share of them
        (``SHUTDOWN_INTERRUPT_SHARE``) the operator stops the command as it makes one kind
        of call (``SimShutdownCalls.interrupt``), as ``asyncio.run`` does on Ctrl-C; in
        half of those its machine dies too, so no call of it reaches anything (no thaw)."""
        calls = SimShutdownCalls(self)
        draw = random.Random(self.seed * 7919 + self.stats.shutdowns)
        if draw.random() < SHUTDOWN_INTERRUPT_SHARE:
            calls.interrupt_at = draw.choice(("freeze", "poll", "poll", "stop", "finish"))
            calls.dies = draw.random() < 0.5
        return calls

    async def _shutdown(self, calls: SimShutdownCalls | None = None) -> tuple[int | None, str]:
        """``squall cluster shutdown`` as the CLI runs it (``run_shutdown``), over the
        servicers; its exit status (None: abandoned or interrupted) and what it printed or
        raised."""
        self.shutting_down = True
        self.note("operator: cluster shutdown")
        out = io.StringIO()
        calls = calls or SimShutdownCalls(self)
        calls.command = asyncio.current_task()
        try:
            code: int | None = await run_shutdown(
                calls,
                self._running_nodes(),
                out,
                clock=self.clock,
                timeout_s=SHUTDOWN_TIMEOUT_S,
                operator="sim-operator",
                shutdown_id=f"sim-{self.seed}-{self.stats.shutdowns}",
            )
        except ShutdownError as exc:
            code = None
            out.write(str(exc))
            if "interrupted before any service was stopped" in str(exc) and (
                "every replica serves again" in str(exc)
            ):
                self.stats.shutdowns_interrupted += 1
        finally:
            self.shutting_down = False
        self.stats.shutdowns += 1
        text = out.getvalue().strip().replace("\n", " / ")
        self.note(f"operator: cluster shutdown -> {code}: {text}")
        return code, text

    async def _before_heal(self) -> None:
        """A cluster shutdown the operator started among the faults runs to its end
        first: the heal then starts whatever it stopped."""
        deadline = self.loop.time() + SHUTDOWN_TIMEOUT_S + shell_sim.LIVENESS_S
        while self.shutting_down and self.loop.time() < deadline:
            await asyncio.sleep(0.1)
        # A command that died left its freezes to lapse after their hold: the cluster is
        # expected to serve once they have (each at most the command's timeout and the
        # finishing margin after it froze).
        deadline = self.loop.time() + SHUTDOWN_TIMEOUT_S + FINISH_HOLD_S + 1.0
        frozen = self._frozen_replicas()
        while self._frozen_replicas() and self.loop.time() < deadline:
            await asyncio.sleep(0.1)
        lapsed = [node for node in frozen if node not in self._frozen_replicas()]
        if lapsed:
            self.stats.freezes_lapsed += len(lapsed)
            self.note(f"freezes lapsed or ended: {','.join(lapsed)}")

    def _frozen_replicas(self) -> list[str]:
        """Running replicas frozen for a shutdown that did not finish them."""
        return [
            member.node_id
            for member in self.members.values()
            if member.replica is not None
            and member.replica.frozen_for
            and not member.replica.core.shutdown_finished
        ]

    def _running_nodes(self) -> list[NodeConfig]:
        """The nodes as the operator's config file names them (a replacing machine's
        addresses after a replace-node)."""
        return [(m.config or self.config).node(m.node_id) for m in self.members.values()]

    def _check_churn(self) -> None:
        """Master epochs grow with what disrupted the cluster, not with time: no node makes
        its group re-form again and again (EPOCHS_PER_DISRUPTION_MAX)."""
        disruptions = self.stats.disruptions
        bound = EPOCHS_PER_DISRUPTION_MAX * disruptions + EPOCHS_SLACK
        if self.stats.elections > bound:
            raise self.fail(
                f"churn: the clients saw {self.stats.elections} master epochs for "
                f"{disruptions} disruptions (at most {bound})"
            )

    async def _after_checks(self) -> None:
        """In a share of the seeds: the healed cluster is shut down cleanly, every node is
        started again, and it serves with every acknowledged event."""
        if random.Random(self.seed * 104729 + 5).random() >= SHUTDOWN_SHARE:
            return
        # The operator asks again while none could start or it was abandoned (a group
        # still settling: a higher-ranked node taking over once caught up), as the
        # command's message says to.
        deadline = self.loop.time() + shell_sim.LIVENESS_S
        code, text = await self._shutdown()
        while code is None and self.loop.time() < deadline:
            await asyncio.sleep(0.5)
            code, text = await self._shutdown()
        if code != 0:
            raise self.fail(f"cluster shutdown of the healed cluster failed ({code}): {text}")
        # Every service stopped; the master's group's stores are CLEAN at one point (a node
        # that was not a member then, rejoining, stays DIRTY and is updated at the start).
        points = set()
        for member in self.members.values():
            coordinator = self.coordinators[member.node_id]
            if member.replica is not None or coordinator.node is not None:
                raise self.fail(f"{member.node_id} still runs after the cluster shutdown")
            meta = Store(member.disk.kv).meta()
            if meta.state == common_pb2.STORE_STATE_CLEAN:
                points.add((meta.last_epoch, meta.last_lsn))
        if len(points) != 1:
            raise self.fail(f"the clean stores end at different points {points}: {text}")
        self.note("stores shut down; the operator starts every node again")
        follow = Every(self.loop, FOLLOW_S, self._follow_master, first_s=0)
        tick = Every(self.loop, shell_sim.NETWORK_TICK_S, self.net.tick)
        for member in self.members.values():
            await self._restart(member)
        for coordinator in self.coordinators.values():
            self._start_coordinator(coordinator)
        await self._liveness(self.loop.time())
        await self._catch_up()
        follow.cancel()
        tick.cancel()
        self._check_logs()

    # --- node changes: a machine gone for good, replaced; a node removed, added back
    # (docs/operations.md, "Changing the membership")

    def _learners(self) -> set[str]:
        """The learners of the newest node set any running coordinator holds (highest
        epoch, then version: the set groups go on with): nodes not yet caught up and
        promoted, which do not vote."""
        sets = [c.node.election.membership for c in self.coordinators.values() if c.node]
        if not sets:
            return set()
        newest = max(sets, key=lambda m: (m.epoch, m.version))
        return {m.node_id for m in newest.members if m.learner}

    def _named_learners(self) -> set[str]:
        """Every node that some coordinator's node set names as a learner, not only the
        newest set's: a coordinator invited under a change whose group never formed keeps
        that set, while the cluster goes on under the older one (seed 5484: after a failed
        promotion n3 held a set in which it votes). A crashed coordinator's set is the
        one its state file holds, which it starts from again (seed 24294: with every
        coordinator down, n2's machine was lost while the set it had persisted named n1 a
        learner, leaving n3 the one voter of two)."""
        named = set()
        for c in self.coordinators.values():
            membership = c.node.election.membership if c.node else c.state.load().membership
            if membership is not None:
                named.update(m.node_id for m in membership.members if m.learner)
        return named

    def _operator_replaces(self) -> None:
        """The operator's replace-node (or add-node of a removed node) during the faults,
        asked again after a refusal."""
        if self.healing or not self.gone:
            return  # the heal finishes it (_finish_replacement)

        async def attempt() -> None:
            if not await self._replace() and not self.healing:
                self.loop.call_later(REPLACE_RETRY_S, self._operator_replaces)

        self.loop.create_task(attempt())  # the operator's machine: no simulated process

    async def _finish_replacement(self) -> None:
        """At the heal: the operator brings the node set back to every node. A gone
        machine's node is replaced, a removed node added back (its peers run again, so a
        majority of the old and the new node set can form); a node whose removal the
        operator saw time out but which was done since is stopped and wiped first."""
        deadline = self.loop.time() + shell_sim.LIVENESS_S
        while True:
            if not self.gone:
                missing = await self._missing_member(deadline) if self.removes_asked else ""
                if not missing:
                    return
                self.note(f"operator: {missing} is not in the running set: removed since")
                self._decommission(missing)
            if self.loop.time() > deadline:
                raise self.fail(
                    f"{'add-node' if self.gone_removed else 'replace-node'} {self.gone} "
                    f"not done {shell_sim.LIVENESS_S} s after the heal"
                )
            if not await self._replace():
                await asyncio.sleep(REPLACE_RETRY_S)

    async def _missing_member(self, deadline: float) -> str:
        """A node the running node set lacks, as ``squall status`` shows it on the leading
        coordinator once no change is in progress there ("" for none); fails at the
        deadline."""
        while self.loop.time() <= deadline:
            coordinator = self._leading()
            running = None if coordinator is None else self._settled_set(coordinator)
            if running is not None:
                return next((n for n in NODE_IDS if running.member(n) is None), "")
            await asyncio.sleep(0.1)
        raise self.fail(f"no settled node set {shell_sim.LIVENESS_S} s after the heal")

    async def _remove(self, node_id: str) -> None:
        """``squall cluster remove-node`` of a running member as the CLI runs it, asked of
        the leading coordinator and waited for; once done, the operator stops the node's
        services and wipes its machine, and adds it back later (``_operator_replaces``)."""
        async with self._replacing:
            coordinator = self._leading()
            if self.gone or self.healing or coordinator is None:
                return
            if node_id == coordinator.node_id and self.rng.random() < REMOVE_OTHER:
                node_id = self.rng.choice([n for n in NODE_IDS if n != node_id])
            if node_id == self.older:
                # Its log may take joined entries once it is out, which its release, added
                # back, would not read: an operator adds machines of the running release.
                return
            request = coordinator_pb2.ChangeMembershipRequest(
                kind=coordinator_pb2.MEMBERSHIP_CHANGE_KIND_REMOVE_NODE,
                node_id=node_id,
                operator="sim-operator",
                reason="decommission",
            )
            what = f"remove-node {node_id}"
            self.removes_asked += 1
            if not await self._ask(coordinator, request, what):
                return
            if await self._changed(coordinator, node_id, None) is None:
                self.note(f"operator: {what} not done")
                return
            self.note(f"operator: {what} done")
            self._decommission(node_id)
        self.loop.call_later(self.rng.uniform(0.5, 3.0), self._operator_replaces)

    def _decommission(self, node_id: str) -> None:
        """The operator stops a removed node's services; its machine is wiped when it is
        added back (``_new_machine``)."""
        member = self.members[node_id]
        coordinator = self.coordinators[node_id]
        if coordinator.node is not None:
            self._crash_coordinator(coordinator)
        if member.replica is not None:
            self._crash(member, machine=False)
        self.gone, self.gone_removed = node_id, True
        self.stats.removals += 1
        self.note(f"operator: {node_id}'s services stopped, its machine to be wiped")

    async def _ask(
        self, coordinator: Coordinator, request: coordinator_pb2.ChangeMembershipRequest, what: str
    ) -> bool:
        """One membership change asked of coordinator through its servicer, in its
        process, within the CLI's call timeout; False (noted) when it was refused or not
        answered."""
        node = coordinator.node
        assert node is not None
        self.note(f"operator: {what} (asked of {node.node.id})")
        call = self.loop.spawn(
            coordinator.process,
            coordinator_server.Coordinator(node).ChangeMembership(request, _ServicerContext()),
        )
        await asyncio.wait({call}, timeout=OPERATOR_TIMEOUT_S)
        refused = (
            "no answer in time"
            if not call.done()
            else "its coordinator's process ended"
            if call.cancelled()
            else call.exception()
        )
        if refused:
            if isinstance(refused, BaseException) and not isinstance(refused, _Aborted):
                raise refused
            self.note(f"operator: {what} refused: {refused}")
            return False
        return True

    async def _replace(self) -> bool:
        """``squall cluster replace-node`` of the gone machine's node (``add-node`` of a
        removed one) as the CLI runs it (services/cli/membership.py): the change asked of
        the leading coordinator through its servicer, waited for until done; then ``config
        export`` and the new machine started from it, empty. False when it was refused or
        not done in time."""
        async with self._replacing:
            node_id = self.gone
            coordinator = self._leading()
            if not node_id or coordinator is None:
                return False
            verb = "add-node" if self.gone_removed else "replace-node"
            # The operator reads the status first: a change it asked before and saw time
            # out may be done since (the node set names one of its new machines).
            running = self._settled_set(coordinator)
            member = None if running is None else running.member(node_id)
            if running is not None and member is not None and member.replica_address in self._asked:
                self.note(f"operator: {verb} {node_id} found done: {running.describe()}")
                await self._new_machine(node_id, running)
                return True
            self._machines += 1
            host = f"{node_id}-m{self._machines}.sim"
            kind = (
                coordinator_pb2.MEMBERSHIP_CHANGE_KIND_ADD_NODE
                if self.gone_removed
                else coordinator_pb2.MEMBERSHIP_CHANGE_KIND_REPLACE_NODE
            )
            request = coordinator_pb2.ChangeMembershipRequest(
                kind=kind,
                node_id=node_id,
                coordinator_address=f"{host}:7101",
                replica_address=f"{host}:7201",
                priority=self.config.node(node_id).priority if self.gone_removed else 0,
                operator="sim-operator",
                reason="machine gone" if not self.gone_removed else "added back",
            )
            what = f"{verb} {node_id} with {host}"
            self._asked.add(request.replica_address)
            if not await self._ask(coordinator, request, what):
                return False
            running = await self._changed(coordinator, node_id, request.replica_address)
            if running is None:
                self.note(f"operator: {what} not done")
                return False
            self.note(f"operator: {what} done: {running.describe()}")
            await self._new_machine(node_id, running)
            return True

    @staticmethod
    def _settled_set(coordinator: Coordinator) -> Membership | None:
        """The running node set ``squall status`` shows on coordinator, unless a change is
        in progress there."""
        node = coordinator.node
        if node is None or coordinator.paused or coordinator.stopping:
            return None
        status = node.status()
        return None if "in progress" in status.membership_change else status.membership

    async def _changed(
        self, coordinator: Coordinator, node_id: str, replica_address: str | None
    ) -> Membership | None:
        """The running node set once the change is done there (the CLI's --wait, then the
        set ``config export`` writes): node_id at replica_address, or (None) removed."""
        deadline = self.loop.time() + REPLACE_WAIT_S
        while self.loop.time() < deadline:
            node = coordinator.node
            if node is None or coordinator.paused or coordinator.stopping:
                return None  # the CLI's status call fails
            status = node.status()
            running = status.membership
            if "in progress" not in status.membership_change and running is not None:
                member = running.member(node_id)
                if replica_address is None:
                    return running if member is None else None
                changed = member is not None and member.replica_address == replica_address
                return running if changed else None
            await asyncio.sleep(0.1)
        return None

    async def _new_machine(self, node_id: str, running: Membership) -> None:
        """The replacing (or added) machine: an empty disk, no coordinator state, the
        exported config; its replica starts, then its coordinator (docs/operations.md's
        runbook)."""
        member = self.members[node_id]
        member.disk = Disk()
        (member.data_dir / FAULT_FILE_NAME).unlink(missing_ok=True)
        config = dataclasses.replace(
            self.config,
            nodes=tuple(
                NodeConfig(
                    m.node_id,
                    m.priority,
                    m.coordinator_address,
                    m.replica_address,
                    self.members[m.node_id].data_dir,
                    m.learner,
                )
                for m in running.members
            ),
            membership_version=running.version,
            membership_epoch=running.epoch,
        )
        config.validate()
        member.config = config
        coordinator = self.coordinators[node_id]
        coordinator.state = MemoryStateStore()
        coordinator.config = config
        if not self.gone_removed:
            self.stats.replacements += 1
        self.gone, self.gone_removed = "", False
        self._asked.clear()
        await self._start(member)
        self._start_coordinator(coordinator)

    def _resume_coordinator(self, coordinator: Coordinator, process: str) -> None:
        if coordinator.paused and coordinator.process == process and coordinator.node:
            coordinator.paused = False
            self.loop.resume(process)
            self.note(f"resume {process}")

    def _heal_own(self, node_id: str) -> None:
        if self.healing:
            return
        self.own_cuts = {cut for cut in self.own_cuts if cut[0] != node_id}
        self.note(f"heal {node_id}'s coordinator<->replica link")

    def _restart_node(self, node_id: str) -> None:
        if self.healing or node_id == self.gone:
            return  # the heal restarts it; a gone machine is replaced
        member = self.members[node_id]
        coordinator = self.coordinators[node_id]
        if member.replica is None:
            self.loop.create_task(self._restart(member))
        if coordinator.node is None:
            self._start_coordinator(coordinator)


def shell_sim_kinds() -> int:
    """How many fault kinds shell_sim's own _inject knows."""
    return ShellSim.fault_kinds


async def _deliver(node: CoordinatorNode, message: coordinator_pb2.PeerMessage) -> None:
    node.deliver(message)


def run_seed(
    seed: int, *, acks: common_pb2.AckPolicy.ValueType = common_pb2.ACK_POLICY_MAJORITY
) -> Stats:
    """Runs one seed in a temporary directory (the replicas' fault and loss files)."""
    return shell_sim.run_sim(CoordinatedSim, "coord-sim", seed, acks)
