"""Knows which replica is the master by following the coordinators' group views.

The gateway keeps one `WatchGroupView` stream open to every configured coordinator
(reconnecting with bounded, jittered backoff) and derives the master from the newest view
each coordinator reported (`GroupViews`, a pure core with no I/O):

* a NORMAL view naming a master proposes that master for the view's epoch;
* the highest epoch wins, and the gateway never goes back below the highest epoch in
  which it has seen a master (a deposed master's late view cannot win), except, after
  every watch ended, to a group that a majority of the nodes report NORMAL together: once
  a majority formed an epoch, no majority can still be in an older one, so that only
  happens when the cluster's epochs started again (every node restored from a backup,
  their coordinators' state lost with the disks), and the gateway follows the restored
  cluster rather than wait for an epoch it will not see again;
* a view from the master's own coordinator saying it is no longer master of that epoch
  (it lost its group) withdraws it, even while slower slaves still name it;
* when a coordinator's stream ends, its view is forgotten (the others still speak).

While no master is known, calls wait for one (bounded; `MasterTracker.wait_master`), as
IceStorm's clients block while the group is inactive. Only when no coordinator has
answered at all since start-up does the gateway fall back to asking every replica for its
role (highest epoch wins). Every change of master is logged with node and epoch.

The node list is the config file's at start; a view that carries a running node set (a
membership change made one) newer than any seen teaches the gateway the nodes it adds and
the addresses it moves (``GroupViews.learn``), and the tracker then opens channels to them
and watches their coordinators: an added node is reached without restarting the gateway.
A node that set no longer holds (removed) is dropped: its view no longer counts, its
watch stops, and `squall status` no longer lists it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

import grpc

from squall.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall.wire.auth import resolve_token, token_metadata
from squall_server.common.config import ClusterConfig
from squall_server.common.grpc_server import channel_options
from squall_server.common.grpc_tracing import client_interceptors
from squall_server.common.logs import log_fields
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.tls import transport

log = logging.getLogger("squall.gateway")

MASTER_ADDRESS_KEY = "squall-master-address"


class NoMasterError(Exception):
    """No replica currently holds the master role."""


@dataclass(frozen=True)
class NodeSetChange:
    """What a newer running node set changed in the gateway's node list."""

    # Ids added or given new addresses (a replaced node's new machine), sorted.
    moved: tuple[str, ...] = ()
    # Ids the set no longer holds (removed), sorted.
    removed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Master:
    """The master the gateway forwards to."""

    node_id: str
    replica_address: str
    epoch: int


class GroupViews:
    """The newest group view of each coordinator, and the master they imply (pure)."""

    def __init__(
        self,
        replica_addresses: dict[str, str],
        coordinator_addresses: dict[str, str] | None = None,
    ) -> None:
        # node id -> replica address, from the configuration and then the running node
        # set (learn): a view can only name these.
        self._addresses = dict(replica_addresses)
        # node id -> coordinator address (the nodes whose views the gateway watches).
        self.coordinators = dict(coordinator_addresses or {})
        # (epoch, version) of the newest running node set learned; (0, 0): the file's.
        self._set_key = (0, 0)
        self._views: dict[str, coordinator_pb2.GroupView] = {}
        # The highest epoch in which any coordinator reported a master.
        self.epoch_floor = 0
        self.master: Master | None = None
        # The node ids of the master's group (from the view that named it), master first.
        self.members: tuple[str, ...] = ()
        # Set once any coordinator has reported a view.
        self.heard = False
        # Set when every view was forgotten (every watch ended), until a master is known
        # again: only then may a majority's group below the floor be the cluster's.
        self._lost_all = False

    @property
    def views(self) -> dict[str, coordinator_pb2.GroupView]:
        """The newest view per reporting node."""
        return dict(self._views)

    def observe(self, node_id: str, view: coordinator_pb2.GroupView) -> Master | None:
        """Takes node_id's newest view; returns the master it implies now."""
        if node_id not in self._addresses:
            raise ValueError(f"view from unknown node '{node_id}'")
        self.heard = True
        self._views[node_id] = view
        if _names_master(view) and view.master.node_id in self._addresses:
            self.epoch_floor = max(self.epoch_floor, view.epoch)
        self.master = self._derive()
        return self.master

    def address(self, node_id: str) -> str:
        """A known node's replica address."""
        return self._addresses[node_id]

    def learn(self, view: coordinator_pb2.GroupView) -> NodeSetChange:
        """Takes the running node set a view carries when it is newer than any learned:
        its nodes' addresses replace the known ones (an added node, a replaced node's new
        machine), and the nodes it no longer holds are dropped with their views (a removed
        node is never the master of a newer set, and a stale view of it must not name
        it). An older set, or a view carrying none, changes nothing."""
        key = (view.membership_epoch, view.membership_version)
        if not view.membership_version or not view.nodes or key <= self._set_key:
            return NodeSetChange()
        self._set_key = key
        changed: list[str] = []
        held: set[str] = set()
        for node in view.nodes:
            if not node.node_id or not node.replica_address or not node.coordinator_address:
                continue
            held.add(node.node_id)
            known = (self._addresses.get(node.node_id), self.coordinators.get(node.node_id))
            if known != (node.replica_address, node.coordinator_address):
                self._addresses[node.node_id] = node.replica_address
                self.coordinators[node.node_id] = node.coordinator_address
                changed.append(node.node_id)
        # A set whose entries were all unusable names no node: keep the ones known.
        removed = sorted(set(self._addresses) - held) if held else []
        for node_id in removed:
            self._addresses.pop(node_id, None)
            self.coordinators.pop(node_id, None)
            self._views.pop(node_id, None)
        if changed or removed:
            self.master = self._derive()
        return NodeSetChange(tuple(sorted(changed)), tuple(removed))

    def forget(self, node_id: str) -> Master | None:
        """Drops node_id's view (its stream ended); returns the master implied now."""
        self._views.pop(node_id, None)
        if not self._views:
            self._lost_all = True
        self.master = self._derive()
        return self.master

    def _derive(self) -> Master | None:
        best: tuple[int, bool, str] | None = None
        best_view: coordinator_pb2.GroupView | None = None
        for reporter, view in self._views.items():
            if not _names_master(view) or view.epoch < self.epoch_floor:
                continue
            master_id = view.master.node_id
            if master_id not in self._addresses:
                continue
            if self._disowned(view):
                continue
            # Equal epochs name the same master (one master per epoch); prefer the
            # master's own word when there is a choice.
            candidate = (view.epoch, reporter == master_id, master_id)
            if best is None or candidate > best:
                best, best_view = candidate, view
        if best is None or best_view is None:
            best_view = self._restarted_group() if self._lost_all else None
            if best_view is None:
                self.members = ()
                return None
            self.epoch_floor = best_view.epoch
            best = (best_view.epoch, True, best_view.master.node_id)
        self._lost_all = False
        epoch, _, master_id = best
        others = sorted(
            {m.node_id for m in best_view.members if m.node_id in self._addresses} - {master_id}
        )
        self.members = (master_id, *others)
        return Master(master_id, self._addresses[master_id], epoch)

    def _restarted_group(self) -> coordinator_pb2.GroupView | None:
        """A view of the group a majority of the nodes report NORMAL together (the same
        group, epoch and master), below the floor, heard since every watch ended: the
        cluster's epochs started again. (Views held from before are not enough: the
        members of a newer group may still be heard in the old one for a moment.)"""
        together: dict[tuple[str, int, str], list[coordinator_pb2.GroupView]] = {}
        for view in self._views.values():
            if _names_master(view) and view.master.node_id in self._addresses:
                key = (view.group_name, view.epoch, view.master.node_id)
                together.setdefault(key, []).append(view)
        for views in together.values():
            if not self._disowned(views[0]) and len(views) > len(self._addresses) // 2:
                return views[0]
        return None

    def _disowned(self, view: coordinator_pb2.GroupView) -> bool:
        """Whether the master a view names says itself it lost that group."""
        master_id = view.master.node_id
        own = self._views.get(master_id)
        return own is not None and own.epoch >= view.epoch and not _names_master(own, master_id)


def _names_master(view: coordinator_pb2.GroupView, master_id: str | None = None) -> bool:
    """True if the view is NORMAL with a master (that master, if given)."""
    if view.state != common_pb2.NODE_STATE_NORMAL or not view.master.node_id:
        return False
    return master_id is None or view.master.node_id == master_id


def reconnect_options(backoff_initial_ms: int, backoff_max_ms: int) -> list[tuple[str, int]]:
    """Channel reconnect pacing: a restarted node is reached again within backoff_max_ms."""
    return [
        ("grpc.initial_reconnect_backoff_ms", backoff_initial_ms),
        ("grpc.min_reconnect_backoff_ms", backoff_initial_ms),
        ("grpc.max_reconnect_backoff_ms", backoff_max_ms),
    ]


class MasterTracker:
    """The gateway's current master, from the group-view watches, and a channel to every replica."""

    def __init__(
        self,
        config: ClusterConfig,
        gateway_id: str = "",
        *,
        probe_timeout_s: float = 1.0,
        rng: random.Random | None = None,
        running_nodes: RunningNodes | None = None,
    ) -> None:
        self._config = config
        # The node ids the gateway's call guard takes: the file's, and the running set's.
        self.running_nodes = running_nodes or RunningNodes(
            (n.id for n in config.nodes), (g.id for g in config.gateways)
        )
        self._gateway_id = gateway_id
        self._probe_timeout_s = probe_timeout_s
        self._rng = rng or random.Random()
        retry = config.retry
        self._backoff_initial_s = retry.retry_backoff_initial_ms / 1000
        self._backoff_max_s = retry.retry_backoff_max_ms / 1000
        options = [
            *channel_options(config.limits.max_message_bytes),
            *reconnect_options(retry.retry_backoff_initial_ms, retry.retry_backoff_max_ms),
        ]
        # Every link presents this gateway's certificate when [tls] is on.
        self.transport = transport(config, gateway_id)
        # Forwarded calls carry the trace on to the master (interceptors only while tracing).
        self._channels = {
            node.replica_address: self.transport.aio_channel(
                node.replica_address, options=options, interceptors=client_interceptors()
            )
            for node in config.nodes
        }
        self._coordinator_channels = {
            node.id: self.transport.aio_channel(node.coordinator_address, options=options)
            for node in config.nodes
        }
        # With [auth] on, a coordinator trusts this gateway by its TLS certificate; without
        # TLS it needs a token, taken from $SQUALL_TOKEN or $SQUALL_TOKEN_FILE (docs/auth.md).
        self._own_metadata = token_metadata(resolve_token())
        self._options = options
        self._views = GroupViews(
            {node.id: node.replica_address for node in config.nodes},
            {node.id: node.coordinator_address for node in config.nodes},
        )
        self._watch_by_node: dict[str, asyncio.Task[None]] = {}
        # Set on every change of master; waiters take the current event before waiting.
        self._changed = asyncio.Event()
        # Set on every view a coordinator reports or loses (a group's members can change
        # without its master changing).
        self._views_changed = asyncio.Event()
        self._probed: Master | None = None
        self._probe_lock = asyncio.Lock()
        self._watches: list[asyncio.Task[None]] = []
        # Coordinator channels replaced by a moved address, closed with the rest.
        self._retired: list[grpc.aio.Channel] = []

    # --- what the forwarder and the status view use

    @property
    def master(self) -> Master | None:
        """The master now: from the views, or (before any coordinator answered) a probe."""
        if self._views.heard:
            return self._views.master
        return self._probed

    @property
    def master_id(self) -> str:
        """The current master's node id ("" when none)."""
        master = self.master
        return master.node_id if master else ""

    @property
    def epoch(self) -> int:
        """The current master's epoch (0 when none)."""
        master = self.master
        return master.epoch if master else 0

    def group(self) -> list[tuple[str, str]]:
        """(node id, replica address) of every member of the master's group, master first
        ([] while none is known; only the master before any coordinator answered)."""
        master = self.master
        if master is None:
            return []
        if not self._views.heard:
            return [(master.node_id, master.replica_address)]
        return [(node_id, self._views.address(node_id)) for node_id in self._views.members]

    def channel_to(self, address: str) -> grpc.aio.Channel:
        """The channel to one replica."""
        return self._channels[address]

    def knows(self, address: str) -> bool:
        """True if the address is a configured replica."""
        return address in self._channels

    async def wait_master(self, timeout_s: float) -> Master | None:
        """The master, waiting up to timeout_s for the views to name one (None if none)."""
        # The first probe runs even with no time to wait; the event loop keeps the
        # deadline of the rest (no clock is read here).
        if not self._views.heard and self._probed is None:
            await self._probe_once()
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                # Bounded by the timeout: each pass waits for the views to change.
                while self.master is None:
                    await self._changed.wait()
                    if not self._views.heard and self._probed is None:
                        await self._probe_once()
        except TimeoutError:
            pass
        return self.master

    async def channel(self, timeout_s: float = 0.0) -> grpc.aio.Channel:
        """The master's channel, waiting up to timeout_s for one; NoMasterError if none."""
        master = await self.wait_master(timeout_s)
        if master is None:
            raise NoMasterError(
                "no master is elected (or reachable) right now; the call was not forwarded"
            )
        return self._channels[master.replica_address]

    async def moved_from(self, address: str) -> Master:
        """Waits until the views name a master other than the replica at `address`.

        A publish stream forwarded to a master that was deposed meanwhile ends then: a
        master that hangs (paused, a stuck disk) cannot end its streams itself.
        """
        # Bounded: each pass waits for the next change of master; the caller cancels it.
        while True:
            master = self.master
            if master is not None and master.replica_address != address:
                return master
            changed = self._changed
            await changed.wait()

    async def left_group(self, node_id: str) -> Master:
        """Waits until the views name a master whose group leaves out `node_id`.

        A read spread to a slave ends then: a slave whose replica hangs (paused, a stuck
        disk) cannot end its streams itself, but its coordinator takes the node out of the
        group within the replica timeout, and its readers must go on elsewhere.
        """
        # Bounded: each pass waits for the next view; the caller cancels it.
        while True:
            master = self.master
            if master is not None and self._views.heard and node_id not in self._views.members:
                return master
            changed = self._views_changed
            await changed.wait()

    # --- the watches

    def start(self) -> None:
        """Opens a group-view watch to every coordinator."""
        for node in self._config.nodes:
            self._start_watch(node.id)

    def _start_watch(self, node_id: str) -> None:
        task = asyncio.create_task(self._watch(node_id), name=f"watch-{node_id}")
        self._watches.append(task)
        self._watch_by_node[node_id] = task

    def nodes(self) -> list[tuple[str, str, str]]:
        """(node id, coordinator address, replica address) of every node known: the file's
        and those the running node set added, by id."""
        return sorted(
            (node_id, address, self._views.address(node_id))
            for node_id, address in self._views.coordinators.items()
        )

    def coordinator_channel(self, node_id: str) -> grpc.aio.Channel:
        """The channel to a known node's coordinator."""
        return self._coordinator_channels[node_id]

    def _follow(self, change: NodeSetChange) -> None:
        """Nodes the running node set added or moved: channels to their replica and
        coordinator, and a watch of the coordinator (restarted at a moved address). Nodes
        it removed: their watch stops and their coordinator channel is retired (closed
        with the rest; a status call may still hold it). Replica channels stay: a call
        forwarded there before the change ends on its own."""
        for node_id in change.removed:
            watch = self._watch_by_node.pop(node_id, None)
            if watch is not None:
                watch.cancel()  # the watch running this very call too: it ends at its next await
            old = self._coordinator_channels.pop(node_id, None)
            if old is not None:
                self._retired.append(old)
            log.info(
                "gateway %s: node %s is not in the running node set any more: dropped",
                self._gateway_id,
                node_id,
            )
        for node_id in change.moved:
            replica = self._views.address(node_id)
            coordinator = self._views.coordinators[node_id]
            if replica not in self._channels:
                self._channels[replica] = self.transport.aio_channel(
                    replica, options=self._options, interceptors=client_interceptors()
                )
            old = self._coordinator_channels.get(node_id)
            self._coordinator_channels[node_id] = self.transport.aio_channel(
                coordinator, options=self._options
            )
            watch = self._watch_by_node.get(node_id)
            if watch is not None:
                watch.cancel()
            if old is not None:
                self._retired.append(old)
            self._start_watch(node_id)
            log.info(
                "gateway %s: node %s (coordinator %s, replica %s) from the running node set: "
                "watching it",
                self._gateway_id,
                node_id,
                coordinator,
                replica,
            )

    async def _watch(self, node_id: str) -> None:
        """Follows one coordinator's views for ever, reconnecting with bounded backoff."""
        stub = coordinator_pb2_grpc.CoordinatorStub(self._coordinator_channels[node_id])
        failures = 0
        while True:
            call = stub.WatchGroupView(
                coordinator_pb2.WatchGroupViewRequest(), metadata=self._own_metadata or None
            )
            try:
                async for view in call:
                    failures = 0
                    self._observe(node_id, view)
            except grpc.aio.AioRpcError as error:
                if failures == 0:
                    log.info(
                        "gateway %s: group-view watch of %s ended: %s",
                        self._gateway_id,
                        node_id,
                        error.code().name,
                    )
            finally:
                # On cancellation (the gateway stopping) too: never leave a stream open.
                call.cancel()
            self._forget(node_id)
            failures += 1
            # Full jitter below a doubling ceiling, capped: a dead coordinator costs one
            # cheap connection attempt per backoff_max at most.
            ceiling_s = min(self._backoff_max_s, self._backoff_initial_s * (1 << min(failures, 16)))
            await asyncio.sleep(self._rng.uniform(0, ceiling_s))

    def _observe(self, node_id: str, view: coordinator_pb2.GroupView) -> None:
        if view.node_id and view.node_id != node_id:
            log.warning(
                "gateway %s: coordinator at %s's address reports itself as %s; view ignored",
                self._gateway_id,
                node_id,
                view.node_id,
            )
            return
        if node_id not in self._views.coordinators:
            return  # dropped by a newer running node set; its watch is ending
        before, floor = self.master, self._views.epoch_floor
        self._views.observe(node_id, view)
        if self._views.epoch_floor < floor:
            log.warning(
                "gateway %s: a majority of the nodes report group %s in epoch %d, below "
                "epoch %d seen before: the cluster's epochs started again (its nodes "
                "restored from a backup); following it",
                self._gateway_id, view.group_name, self._views.epoch_floor, floor,
            )  # fmt: skip
        change = self._views.learn(view)
        if change.moved or change.removed:
            self._follow(change)
            self.running_nodes.follow(self._views.coordinators)
        self._views_seen()
        self._announce(before, f"group view of {node_id}")

    def _forget(self, node_id: str) -> None:
        before = self.master
        self._views.forget(node_id)
        self._views_seen()
        self._announce(before, f"watch of {node_id} ended")

    def _views_seen(self) -> None:
        changed, self._views_changed = self._views_changed, asyncio.Event()
        changed.set()

    def _announce(self, before: Master | None, source: str) -> None:
        """Logs a change of master and wakes the calls waiting for one."""
        after = self.master
        if after == before:
            return
        if after is not None:
            log_fields(
                log,
                logging.INFO,
                f"gateway {self._gateway_id}: master is {after.node_id} at "
                f"{after.replica_address} (from the {source})",
                node=after.node_id,
                epoch=after.epoch,
            )
        else:
            lost = before.node_id if before else ""
            log_fields(
                log,
                logging.INFO,
                f"gateway {self._gateway_id}: no master (was {lost}; from the {source}); "
                "calls wait for the next one",
                node=lost,
                epoch=before.epoch if before else 0,
            )
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # --- the start-up fallback: ask the replicas

    async def _probe_once(self) -> None:
        """Asks every replica for its role; only used before any coordinator has answered."""
        async with self._probe_lock:
            if self._views.heard:
                return
            before = self.master
            self._probed = await self._probe_all()
            self._announce(before, "replicas' roles (no coordinator has answered)")

    def suspect(self, address: str) -> None:
        """A forward to address failed without a redirect: drop it if only a probe named it.

        Views are not second-guessed (the coordinators know better than one failed call);
        a probed master is forgotten, so the next call probes again.
        """
        if not self._views.heard and self._probed is not None:
            if self._probed.replica_address == address:
                before = self.master
                self._probed = None
                self._announce(before, f"failed call to {address}")

    async def _probe(self, address: str) -> replica_pb2.ReplicaState | None:
        stub = replica_pb2_grpc.ReplicaControlStub(self._channels[address])
        try:
            state: replica_pb2.ReplicaState = await stub.GetReplicaState(
                replica_pb2.GetReplicaStateRequest(), timeout=self._probe_timeout_s
            )
            return state
        except grpc.aio.AioRpcError:
            return None

    async def _probe_all(self) -> Master | None:
        addresses = list(self._channels)
        states = await asyncio.gather(*(self._probe(a) for a in addresses))
        masters = [
            (state.epoch, address, state.node_id)
            for address, state in zip(addresses, states, strict=True)
            if state is not None and state.role == common_pb2.ROLE_MASTER
        ]
        if not masters:
            return None
        epoch, address, node_id = max(masters)
        return Master(node_id, address, epoch)

    async def close(self) -> None:
        """Stops the watches and closes every channel."""
        for task in self._watches:
            task.cancel()
        for task in self._watches:
            try:
                await task
            except asyncio.CancelledError:
                pass
        channels = [
            *self._channels.values(),
            *self._coordinator_channels.values(),
            *self._retired,
        ]
        await asyncio.gather(*(c.close(None) for c in channels))


def redirect_address(metadata: object) -> str:
    """The master address a slave named in its trailing metadata ("" if none)."""
    for key, value in pairs(metadata):
        if key == MASTER_ADDRESS_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def pairs(metadata: object) -> list[tuple[str, str | bytes]]:
    """Metadata as (key, value) pairs (grpc-stubs types its items too narrowly)."""
    return [(str(k), v) for k, v in metadata or ()]  # type: ignore[attr-defined]
