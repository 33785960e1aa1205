"""Election scenarios as readable transcripts (etcd-raft's testdata style), plus unit tests of
bad input and operator controls.

Each file under tests/unit/scenarios/ is a list of blocks:

    # why this step matters (comments are kept)
    command args
    ----
    the output it produced

The test replays every command on a small in-memory cluster of ``Election`` machines and
compares the output. After an intended change of behaviour, regenerate the files with
``SQUALL_REWRITE=1 .venv/bin/pytest tests/unit/test_election_scenarios.py`` and review the
diff like code.

Commands:
    cluster 1:3 2:2 3:1        nodes as id:priority (a cluster starts with empty stores)
    start 1 2 [epoch=N max=M]  start nodes (the optional values overwrite what is on disk)
    crash 3 / restart 3 [epoch=N]
                               a crash stops the node's coordinator and replica: a restarted
                               replica has not joined until it takes a role again
    store 3 state=clean shutdown=s1 cluster=c1 log=2/40
                               set a stopped node's store (an operator's offline tools)
    run ms=N [trace=all]       deliver messages instantly and fire timers for N ms; by default
                               heartbeats and unanswered probes that change nothing are elided
    partition 1,2|3 / heal     messages across the cut are dropped
    write 3 n=5                node 3's replica (a master) appends n entries; followers copy
    catchup 1 hold|done        node 1's replica, as a slave, copies nothing (hold: it is still
                               truncating and fetching) or has caught up (done: it holds the
                               master's log); a master reports only followers on its history
    logs                       every replica's role and log (epoch/LSN)
    send 9->1 Body key=value   deliver a hand-made message and show what it produced
    designate 1 on|off         operator: designated primary (by=who)
    override 1 N               operator: quorum override (by=who reason=why)
    transfer 1 to=3            operator: node 1 (the master) hands its group to node 3 (by=who);
                               the replica twin is always caught up, as the driver ensures
    quarantine 2 on|off        operator: quarantine node 2, or clear it (by=who reason=why)
    fault 2 id=f1              node 2's replica reports a fault (reason=why)
    replica 2 kill|pause       node 2's replica process alone dies (its role and joined flag
                               are lost) or hangs; its coordinator stays up, and its driver
                               reports the replica silent from now on
    replica 2 restart|resume   the replica answers again (the driver reports it); the role
                               commands it missed are applied from then on
    audit 1                    node 1's audit trail
    status [1 2 ...]           each node's status line
    settings all|3 k=v ...     the agreed settings (cluster name, nodes, durability, limits)
                               of every node, or of stopped node 3, from its next start
    spare 4:1                  a node not in the cluster yet (not started); its config file
                               lists the cluster's nodes and itself, as an exported file does
    member 1 add 4 prio=1      operator: node 1 (the master) changes the node set: add 4,
    member 1 remove 3          remove 3, replace 3 (new addresses: coord=h:p replica=h:p;
    member 1 replace 3         the defaults are h<id>b:1 and h<id>b:2) or set 3's priority
    member 1 priority 3 5      (by=who reason=why); node addresses are h<id>:1 and h<id>:2
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from squall_server.coordinator.agreement import settings_digest
from squall_server.coordinator.election import Election, ElectionConfig, ElectionConfigError
from squall_server.coordinator.membership import ChangeKind, MembershipChange
from squall_server.coordinator.messages import (
    Accept,
    AreYouCoordinator,
    AreYouCoordinatorReply,
    AreYouThere,
    AreYouThereReply,
    Body,
    GroupReady,
    GroupReadyAck,
    Invitation,
    LeadershipTransfer,
    Leave,
    LogLevel,
    MemberReport,
    NodeState,
    PeerMessage,
    PersistedState,
    Ready,
    RejectCode,
    ReplicaReport,
    Role,
    RoleCommandKind,
    StoreState,
    format_message,
    format_role_command,
)
from tests.unit.transcripts import check_or_rewrite, parse_transcript, render

SCENARIOS = Path(__file__).parent / "scenarios"
# Deliveries per `run` or `deliver` before the harness calls it a message storm.
STEPS_MAX = 100_000


@dataclass
class Store:
    """One node's durable state: the coordinator's persisted record and the replica's log."""

    persisted: PersistedState = field(default_factory=PersistedState)
    cluster_id: str = ""
    last_epoch: int = 0
    last_lsn: int = 0
    role: Role = Role.INACTIVE
    epoch: int = 0
    master: str = ""
    applied_seq: int = 0
    state: StoreState = StoreState.EMPTY
    shutdown_id: str = ""
    joined: bool = False
    # The replica process alone is dead or hung: it applies no role command, reports nothing.
    down: bool = False
    # As a slave it copies nothing yet (still truncating and fetching: ``catchup``).
    catching_up: bool = False

    def report(self) -> ReplicaReport:
        """The replica's report as the driver would read it."""
        return ReplicaReport(
            cluster_id=self.cluster_id,
            last_epoch=self.last_epoch,
            last_lsn=self.last_lsn,
            store_state=self.state,
            active=self.role is not Role.INACTIVE,
            command_seq=self.applied_seq,
            shutdown_id=self.shutdown_id,
            joined=self.joined,
        )

    def take_role(self, cluster_id: str) -> None:
        """The replica takes a role: it records the group's cluster id; its store is in use."""
        self.cluster_id = self.cluster_id or cluster_id
        self.state, self.shutdown_id, self.joined = StoreState.DIRTY, "", True


class Cluster:
    """A few Election machines on an instant, ordered network, driven by transcript commands."""

    def __init__(self, priorities: dict[str, int]) -> None:
        """Nodes with empty stores; none started."""
        self.priorities = priorities
        self.now_ms = 0
        self.nodes: dict[str, Election | None] = {node: None for node in priorities}
        self.stores: dict[str, Store] = {node: Store() for node in priorities}
        self.group_counters: dict[str, int] = {node: 0 for node in priorities}
        self.queue: list[PeerMessage] = []
        self.cut: set[frozenset[str]] = set()
        self.out: list[str] = []
        self.trace_all = False
        # Each node's agreed settings (the ``settings`` command); none: nothing compared.
        self.settings: dict[str, dict[str, str]] = {node: {} for node in priorities}
        # Each node's config file's node set (a spare's adds itself).
        self.files: dict[str, dict[str, int]] = {node: dict(priorities) for node in priorities}

    def add_spare(self, node: str, priority: int) -> None:
        """A node started later from a file that lists the cluster and itself."""
        self.nodes[node] = None
        self.stores[node] = Store()
        self.group_counters[node] = 0
        self.settings[node] = {}
        self.files[node] = {**self.priorities, node: priority}

    # -- driving

    def start(self, node: str) -> None:
        """Start (or restart) a node from its store."""

        def new_group_id(node: str = node) -> str:
            self.group_counters[node] += 1
            return f"g{self.group_counters[node]}"

        store = self.stores[node]
        config = ElectionConfig(
            node_id=node,
            priorities=self.files[node],
            agreed_settings=tuple(sorted(self.settings[node].items())),
            addresses={x: (f"h{x}:1", f"h{x}:2") for x in self.files[node]},
        )
        election = Election(config, store.persisted, new_group_id)
        self.nodes[node] = election
        self.apply(node, election.tick(self.now_ms), f"{node} start")

    def crash(self, node: str) -> None:
        """Stop a node; its store (persisted state and replica log) survives."""
        self.nodes[node] = None
        store = self.stores[node]
        store.role, store.applied_seq, store.joined = Role.INACTIVE, 0, False
        self.out.append(f"t={self.now_ms} {node} crashed")

    def apply(self, node: str, ready: Ready, heading: str, elide: bool = False) -> None:
        """Apply a Ready as the driver does (persist, send, role) and print it."""
        lines: list[str] = []
        store = self.stores[node]
        if ready.rejection is not None:
            lines.append(f"  rejected {ready.rejection.code.status}: {ready.rejection.message}")
        if ready.persist is not None:
            p = ready.persist
            store.persisted = p
            extra = ""
            if p.designated_primary:
                extra += " designated"
            if p.quorum_override:
                extra += f" override={p.quorum_override}"
            if p.cluster_id:
                extra += f" cluster={p.cluster_id}"
            if p.quarantine is not None:
                extra += " quarantined"
            if p.peer_designated:
                extra += f" peer-designated={','.join(p.peer_designated)}"
            if p.losses:
                extra += f" losses={','.join(r.loss_id for r in p.losses)}"
            if p.acked_loss_ids:
                extra += f" acked-losses={len(p.acked_loss_ids)}"
            if p.membership is not None:
                m = p.membership
                extra += f" nodes=v{m.version}@{m.epoch}:" + m.describe().split("): ", 1)[1]
            lines.append(f"  persist epoch={p.epoch} max={p.max_seen}{extra}")
        self.queue.extend(ready.messages)
        follow_up: Ready | None = None
        if ready.role_command is not None and store.down:
            lines.append(f"  role {format_role_command(ready.role_command)} (replica down)")
        elif ready.role_command is not None:
            cmd = ready.role_command
            lines.append(f"  role {format_role_command(cmd)}")
            election = self.nodes[node]
            store.applied_seq = cmd.seq
            if cmd.kind is RoleCommandKind.DEACTIVATE:
                store.role = Role.INACTIVE
                if election is not None:
                    follow_up = election.replica_report(store.report(), self.now_ms)
            elif cmd.kind is RoleCommandKind.MASTER:
                self.become_master(node, cmd.epoch, cmd.sync_source_id, cmd.cluster_id)
            else:
                store.take_role(cmd.cluster_id)
                store.role, store.epoch, store.master = Role.SLAVE, cmd.epoch, cmd.master_id
        if ready.view_changed:
            election = self.nodes[node]
            if election is not None:
                lines.append(f"  view {self.status_line(election)}")
        for event in ready.events:
            if event.level is not LogLevel.DEBUG:
                lines.append(f"  {event.level.value} {event.event}: {event.message}")
        hand_over: Ready | None = None
        if ready.hand_over_to:
            # The driver's hand-over: the replica twin's target is caught up (it lags at most
            # a few entries and copies at once), so the transfer follows at once.
            lines.append(f"  hand over to {ready.hand_over_to}")
            election = self.nodes[node]
            if election is not None:
                hand_over = election.transfer_leadership(
                    ready.hand_over_to, "auto", self.now_ms, "caught up"
                )
        if lines or not elide or self.trace_all:
            self.out.append(f"t={self.now_ms} {heading}")
            self.out.extend(lines)
        if follow_up is not None:
            self.apply(node, follow_up, f"{node} replica report", elide=True)
        if hand_over is not None:
            self.apply(node, hand_over, f"{node} transfer to {ready.hand_over_to}")

    def report_lags(self, node: str) -> None:
        """A master's role renewal answer, as the driver passes it on: how far each follower
        that holds this epoch's log lags (one still on another history is not streaming)."""
        store = self.stores[node]
        election = self.nodes[node]
        if election is None or store.down or store.role is not Role.MASTER:
            return
        lags = {
            other: store.last_lsn - follower.last_lsn
            for other, follower in self.stores.items()
            if follower.role is Role.SLAVE
            and follower.master == node
            and follower.epoch == store.epoch
            and follower.last_epoch == store.last_epoch
            and self.nodes[other] is not None
        }
        if lags:
            self.apply(node, election.slave_lags(lags, self.now_ms), f"{node} slave lags", True)

    def become_master(self, node: str, epoch: int, sync_source: str, cluster_id: str) -> None:
        """The replica twin: sync from the source, then write the epoch-start entry."""
        store = self.stores[node]
        store.take_role(cluster_id)
        source = self.stores[sync_source]
        if (source.last_epoch, source.last_lsn) > (store.last_epoch, store.last_lsn):
            store.last_epoch, store.last_lsn = source.last_epoch, source.last_lsn
        store.role, store.epoch, store.master = Role.MASTER, epoch, node
        self.append(node, 1)

    def append(self, node: str, count: int) -> None:
        """A master appends entries; reachable followers of its epoch copy them at once."""
        store = self.stores[node]
        store.last_epoch = store.epoch
        store.last_lsn += count
        for other, follower in self.stores.items():
            if (
                follower.role is Role.SLAVE
                and follower.master == node
                and follower.epoch == store.epoch
                and self.nodes[other] is not None
                and frozenset((node, other)) not in self.cut
                and not follower.catching_up
            ):
                follower.last_epoch, follower.last_lsn = store.last_epoch, store.last_lsn
                follower.cluster_id = store.cluster_id

    def deliver_all(self) -> None:
        """Deliver queued messages in order, and what they cause, at the current time."""
        for _ in range(STEPS_MAX):
            if not self.queue:
                return
            msg = self.queue.pop(0)
            self.deliver(msg)
        raise AssertionError("message storm: more than STEPS_MAX deliveries at one instant")

    def deliver(self, msg: PeerMessage) -> None:
        """Deliver one message, unless its receiver is down or cut off."""
        heartbeat = is_heartbeat(msg.body)
        target = self.nodes.get(msg.to_node)
        if target is None or frozenset((msg.from_node, msg.to_node)) in self.cut:
            if not heartbeat or self.trace_all:
                why = "down" if target is None else "partitioned"
                self.out.append(f"t={self.now_ms} {format_message(msg)}  (dropped: {why})")
            return
        self.apply(msg.to_node, target.step(msg, self.now_ms), format_message(msg), heartbeat)

    def run(self, duration_ms: int) -> None:
        """Deliver and fire timers until ``duration_ms`` from now."""
        end = self.now_ms + duration_ms
        for _ in range(STEPS_MAX):
            self.deliver_all()
            due = [
                (deadline, node)
                for node, election in self.nodes.items()
                if election is not None and (deadline := election.next_deadline_ms()) is not None
            ]
            if not due:
                break
            deadline = min(d for d, _ in due)
            if deadline > end:
                break
            self.now_ms = max(self.now_ms, deadline)
            for node, election in self.nodes.items():
                nd = election.next_deadline_ms() if election is not None else None
                if election is not None and nd is not None and nd <= self.now_ms:
                    self.apply(node, election.tick(self.now_ms), f"{node} tick", elide=True)
                    self.report_lags(node)
        else:
            raise AssertionError("run did not settle within STEPS_MAX steps")
        self.now_ms = end
        self.deliver_all()

    def status_line(self, election: Election) -> str:
        """One node's status as a short line."""
        s = election.status()
        text = (
            f"{s.state.value} coord={s.coordinator_id} group={s.group_name} epoch={s.epoch} "
            f"max={s.max_seen} role={s.role.value}"
        )
        if s.members:
            text += f" members={','.join(s.members)}"
        if s.quarantine is not None:
            text += " QUARANTINED"
        if s.transfer_target:
            text += f" transfer-to={s.transfer_target}"
        if s.replica_unreachable_since_ms is not None:
            text += f" REPLICA-UNREACHABLE-SINCE={s.replica_unreachable_since_ms}"
        for m in s.config_mismatches:
            text += f" REFUSES={m.node_id}:{m.key}={m.local_value!r}/{m.peer_value!r}"
        if s.membership is not None and s.membership.version:
            text += f" nodes=v{s.membership.version}:" + ",".join(
                x + ("L" if x in s.membership.learners else "") for x in s.membership.ids
            )
        return text


def is_heartbeat(body: Body) -> bool:
    """Messages elided from transcripts unless they change something."""
    if isinstance(body, AreYouThere | AreYouCoordinator):
        return True
    if isinstance(body, AreYouThereReply):
        return body.yes
    if isinstance(body, AreYouCoordinatorReply):
        return not body.is_coordinator
    return False


def parse_kv(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split ``a b k=v`` into positionals and options."""
    positional = [a for a in args if "=" not in a]
    options = dict(a.split("=", 1) for a in args if "=" in a)
    return positional, options


def parse_body(kind: str, options: dict[str, str]) -> Body:
    """Build a hand-made message body for the ``send`` command."""
    group = options.get("group", "")
    if kind == "AreYouCoordinator":
        return AreYouCoordinator(group, int(options.get("priority", "0")))
    if kind == "AreYouThere":
        return AreYouThere(group)
    if kind == "Invitation":
        return Invitation(
            group,
            int(options.get("priority", "0")),
            int(options.get("epoch", "0")),
            options.get("cluster", ""),
            settings_digest=options.get("settings", ""),
        )
    if kind == "Ready":
        members = tuple(options.get("members", "").split(","))
        return GroupReady(
            group_name=group,
            epoch=int(options.get("epoch", "0")),
            members=members,
            sync_source_id=options.get("sync", members[0]),
            coordinator_id=options.get("coordinator", group.partition(":")[0]),
            max_seen=int(options.get("max", "0")),
            cluster_id=options.get("cluster", ""),
        )
    if kind == "ReadyAck":
        return GroupReadyAck(group, int(options.get("epoch", "0")))
    if kind == "Leave":
        return Leave(group, options.get("reason", ""))
    if kind == "LeadershipTransfer":
        return LeadershipTransfer(
            group,
            int(options.get("epoch", "0")),
            options.get("target", ""),
            tuple(options.get("members", "").split(",")),
        )
    raise ValueError(f"send: unknown message kind {kind!r}")


def execute(cluster: Cluster | None, line: str) -> tuple[Cluster | None, list[str]]:
    """Run one transcript command; return the (possibly new) cluster and its output."""
    words = shlex.split(line)
    command, args = words[0], words[1:]
    positional, options = parse_kv(args)
    if command == "cluster":
        priorities = {p.split(":")[0]: int(p.split(":")[1]) for p in positional}
        majority = len(priorities) // 2 + 1
        return Cluster(priorities), [f"{len(priorities)} nodes, majority {majority}"]
    if cluster is None:
        raise ValueError(f"{command}: no cluster yet")
    cluster.out = []
    cluster.trace_all = options.get("trace") == "all"
    if command in ("start", "restart"):
        for node in positional:
            store = cluster.stores[node]
            changes: dict[str, int] = {}
            if "epoch" in options:
                changes["epoch"] = int(options["epoch"])
            if "max" in options:
                changes["max_seen"] = int(options["max"])
            store.persisted = replace(store.persisted, **changes)  # type: ignore[arg-type]
            cluster.start(node)
        cluster.deliver_all()
    elif command == "settings":
        targets = list(cluster.nodes) if positional[0] == "all" else positional
        for node in targets:
            if cluster.nodes[node] is not None:
                raise ValueError(f"settings: node {node} is running; crash it first")
            cluster.settings[node].update(options)
            agreed = tuple(sorted(cluster.settings[node].items()))
            cluster.out.append(
                f"{node}: settings {' '.join(f'{k}={v}' for k, v in agreed)} "
                f"digest={settings_digest(agreed)}"
            )
    elif command == "crash":
        for node in positional:
            cluster.crash(node)
    elif command == "store":
        node = positional[0]
        if cluster.nodes[node] is not None:
            raise ValueError(f"store: node {node} is running; crash it first")
        store = cluster.stores[node]
        if "state" in options:
            store.state = StoreState(options["state"])
            store.shutdown_id = options.get("shutdown", "")
        if "cluster" in options:
            store.cluster_id = options["cluster"]
        if "log" in options:
            last_epoch, _, last_lsn = options["log"].partition("/")
            store.last_epoch, store.last_lsn = int(last_epoch), int(last_lsn)
        shutdown = f"/{store.shutdown_id}" if store.shutdown_id else ""
        cluster.out.append(
            f"{node}: store {store.state.value}{shutdown} cluster={store.cluster_id or '-'} "
            f"log={store.last_epoch}/{store.last_lsn}"
        )
    elif command == "run":
        cluster.run(int(options["ms"]))
    elif command == "partition":
        sides = [side.split(",") for side in " ".join(positional).replace(" ", "").split("|")]
        for i, left in enumerate(sides):
            for right in sides[i + 1 :]:
                cluster.cut |= {frozenset((a, b)) for a in left for b in right}
        cluster.out.append(f"t={cluster.now_ms} partition {' | '.join(','.join(s) for s in sides)}")
    elif command == "heal":
        cluster.cut.clear()
        cluster.out.append(f"t={cluster.now_ms} healed")
    elif command == "write":
        node = positional[0]
        cluster.append(node, int(options.get("n", "1")))
        store = cluster.stores[node]
        cluster.out.append(f"t={cluster.now_ms} {node} log now {store.last_epoch}/{store.last_lsn}")
    elif command == "send":
        sender, _, receiver = positional[0].partition("->")
        msg = PeerMessage(sender, receiver, parse_body(positional[1], options))
        cluster.deliver(msg)
        cluster.deliver_all()
    elif command in ("designate", "override", "transfer", "quarantine", "fault", "ackloss"):
        node = positional[0]
        election = cluster.nodes[node]
        if election is None:
            raise ValueError(f"{command}: node {node} is down")
        who = options.get("by", "operator")
        reason = options.get("reason", "")
        now = cluster.now_ms
        if command == "designate":
            ready = election.set_designated_primary(positional[1] == "on", who, now)
        elif command == "override":
            ready = election.set_quorum_override(int(positional[1]), who, now, reason)
        elif command == "transfer":
            ready = election.transfer_leadership(options["to"], who, now, reason)
        elif command == "quarantine":
            ready = election.set_quarantine(positional[1] == "on", who, now, reason)
        elif command == "ackloss":
            ready = election.ack_loss(options["id"], who, now, reason)
        else:
            ready = election.replica_fault(options["id"], reason, now)
        cluster.apply(node, ready, f"{node} {line}")
        cluster.deliver_all()
    elif command == "spare":
        for spec in positional:
            node, _, priority = spec.partition(":")
            cluster.add_spare(node, int(priority))
            cluster.out.append(f"{node}: spare, priority {priority}, not started")
    elif command == "member":
        node, verb, target = positional[:3]
        election = cluster.nodes[node]
        if election is None:
            raise ValueError(f"member: node {node} is down")
        kinds = {
            "add": ChangeKind.ADD,
            "remove": ChangeKind.REMOVE,
            "replace": ChangeKind.REPLACE,
            "priority": ChangeKind.SET_PRIORITY,
        }
        suffix = "b" if verb == "replace" else ""
        change = MembershipChange(
            kinds[verb],
            target,
            priority=int(positional[3] if verb == "priority" else options.get("prio", "0")),
            coordinator_address=options.get("coord", f"h{target}{suffix}:1"),
            replica_address=options.get("replica", f"h{target}{suffix}:2"),
        )
        ready = election.change_membership(
            change, options.get("by", "operator"), cluster.now_ms, options.get("reason", "")
        )
        cluster.apply(node, ready, f"{node} {line}")
        cluster.deliver_all()
    elif command == "replica":
        node, action = positional
        election = cluster.nodes[node]
        if election is None:
            raise ValueError(f"replica: node {node}'s coordinator is down")
        store = cluster.stores[node]
        now = cluster.now_ms
        if action in ("kill", "pause"):
            store.down = True
            if action == "kill":
                store.role, store.joined = Role.INACTIVE, False
            cluster.out.append(f"t={now} {node} replica {action}: silent from now on")
            ready = election.replica_silent(now, now)
        elif action in ("restart", "resume"):
            # A hung replica's lease ran out meanwhile (scenarios pause it for longer).
            store.down, store.role = False, Role.INACTIVE
            cluster.out.append(f"t={now} {node} replica {action}: it answers again")
            ready = election.replica_answered(now)
        else:
            raise ValueError(f"replica: unknown action {action!r}")
        cluster.apply(node, ready, f"{node} {line}")
        cluster.deliver_all()
    elif command == "catchup":
        node, action = positional
        store = cluster.stores[node]
        store.catching_up = action == "hold"
        master = cluster.stores.get(store.master) if store.role is Role.SLAVE else None
        if not store.catching_up and master is not None and master.epoch == store.epoch:
            store.last_epoch, store.last_lsn = master.last_epoch, master.last_lsn
        cluster.out.append(
            f"t={cluster.now_ms} {node} replica "
            + ("catching up: copies nothing yet" if store.catching_up else "caught up")
            + f", log {store.last_epoch}/{store.last_lsn}"
        )
    elif command == "logs":
        for node, store in cluster.stores.items():
            cluster.out.append(
                f"{node}: {store.role.value} log={store.last_epoch}/{store.last_lsn}"
                + (f" master={store.master}" if store.role is Role.SLAVE else "")
            )
    elif command == "audit":
        election = cluster.nodes[positional[0]]
        if election is None:
            raise ValueError(f"audit: node {positional[0]} is down")
        for record in election.status().audit:
            cluster.out.append(
                f"{positional[0]}: t={record.at_ms} {record.operator}: {record.action}"
                + (f" ({record.reason})" if record.reason else "")
            )
    elif command == "losses":
        election = cluster.nodes[positional[0]]
        if election is None:
            raise ValueError(f"losses: node {positional[0]} is down")
        for record in election.status().losses:
            cluster.out.append(f"{positional[0]}: {record.loss_id}: {record.summary()}")
    elif command == "status":
        for node in positional or list(cluster.nodes):
            election = cluster.nodes[node]
            text = "down" if election is None else cluster.status_line(election)
            cluster.out.append(f"{node}: {text}")
    else:
        raise ValueError(f"unknown command {command!r}")
    return cluster, cluster.out


def scenario_files() -> list[Path]:
    """Every transcript, sorted."""
    return sorted(SCENARIOS.glob("*.txt"))


@pytest.mark.parametrize("path", scenario_files(), ids=lambda p: p.stem)
def test_scenario(path: Path) -> None:
    """Replays a transcript; SQUALL_REWRITE=1 rewrites it with the actual output."""
    text = path.read_text()
    blocks = parse_transcript(text)
    cluster: Cluster | None = None
    outputs: list[list[str]] = []
    for block in blocks:
        cluster, output = execute(cluster, block.command)
        outputs.append(list(output))
    check_or_rewrite(path, text, render(blocks, outputs))


# ----------------------------------------------------------------------------- unit tests


def make(
    node: str = "1",
    priorities: dict[str, int] | None = None,
    persisted: PersistedState | None = None,
) -> Election:
    """A started election whose replica reported an empty, stopped store."""
    counter = iter(range(1, 1000))
    election = Election(
        ElectionConfig(node_id=node, priorities=priorities or {"1": 1, "2": 2, "3": 3}),
        persisted or PersistedState(),
        lambda: f"g{next(counter)}",
    )
    election.tick(0)
    election.replica_report(ReplicaReport("", 0, 0, StoreState.EMPTY, command_seq=1), 0)
    return election


def drain(election: Election, now_ms: int) -> None:
    """Fire every timer due up to now_ms."""
    election.tick(now_ms)


BAD_INPUTS: list[tuple[str, PeerMessage, RejectCode]] = [
    (
        "unknown sender",
        PeerMessage("9", "1", AreYouCoordinator("9:x", 1)),
        RejectCode.UNKNOWN_SENDER,
    ),
    (
        "wrong recipient",
        PeerMessage("2", "7", AreYouThere("2:x")),
        RejectCode.WRONG_RECIPIENT,
    ),
    (
        "group name without separator",
        PeerMessage("2", "1", Invitation("2-x", 2, 0)),
        RejectCode.MALFORMED_GROUP_NAME,
    ),
    (
        "group name of an unknown node",
        PeerMessage("2", "1", Invitation("8:x", 2, 0)),
        RejectCode.MALFORMED_GROUP_NAME,
    ),
    (
        "group name with bad characters",
        PeerMessage("2", "1", AreYouThere("2:x y")),
        RejectCode.MALFORMED_GROUP_NAME,
    ),
    (
        "probe for a group the sender does not coordinate",
        PeerMessage("2", "1", AreYouCoordinator("3:x", 2)),
        RejectCode.MALFORMED_GROUP_NAME,
    ),
    (
        "priority disagreeing with the configuration",
        PeerMessage("3", "1", Invitation("3:x", 9, 0)),
        RejectCode.PRIORITY_MISMATCH,
    ),
    (
        "Ready whose members omit the sync source",
        PeerMessage("3", "1", GroupReady("3:x", 5, ("1", "3"), "2", "3", 3)),
        RejectCode.INVALID_MESSAGE,
    ),
    (
        "probe with a malformed cluster id",
        PeerMessage("2", "1", AreYouCoordinator("2:x", 2, cluster_id="bad id!")),
        RejectCode.INVALID_MESSAGE,
    ),
    (
        "Ready with a malformed cluster id",
        PeerMessage("3", "1", GroupReady("3:x", 5, ("1", "3"), "3", "3", 3, cluster_id="x" * 65)),
        RejectCode.INVALID_MESSAGE,
    ),
]


@pytest.mark.parametrize(("why", "msg", "code"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_rejected_and_changes_nothing(
    why: str, msg: PeerMessage, code: RejectCode
) -> None:
    """Bad input gets a clear status, is logged, and leaves the node exactly as it was."""
    election = make()
    before = election.status()
    ready = election.step(msg, 1)
    assert ready.rejection is not None, why
    assert ready.rejection.code is code
    assert ready.rejection.code.status in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
    assert ready.persist is None and ready.messages == () and ready.role_command is None
    assert any(e.level is LogLevel.WARNING for e in ready.events)
    assert election.status() == before


def test_older_epoch_is_refused() -> None:
    """A Ready for an epoch at or below the persisted one is refused with FAILED_PRECONDITION."""
    election = make(persisted=PersistedState(epoch=7, max_seen=3))
    before = election.status()
    ready = election.step(PeerMessage("3", "1", GroupReady("3:x", 6, ("1", "3"), "3", "3", 3)), 5)
    assert ready.rejection is not None
    assert ready.rejection.code is RejectCode.STALE_EPOCH
    assert ready.rejection.code.status == "FAILED_PRECONDITION"
    assert "already accepted epoch 7" in ready.rejection.message
    assert ready.persist is None and not ready.messages
    assert election.status() == before


def test_time_going_backwards_is_a_driver_bug() -> None:
    """The machine refuses a clock that goes backwards instead of misbehaving."""
    election = make()
    election.tick(100)
    with pytest.raises(RuntimeError, match="backwards"):
        election.tick(99)


@pytest.mark.parametrize(
    ("config", "phrase"),
    [
        (ElectionConfig("4", {"1": 1, "2": 1}), "not one of the configured nodes"),
        (ElectionConfig("1", {"1": 0, "2": 0}), "every node has priority 0"),
        (ElectionConfig("1", {"1": -1, "2": 1}), "negative"),
        (ElectionConfig("1", {"1:x": 1}), "node id"),
        (ElectionConfig("1", {"1": 1}, member_timeout_ms=150), "twice heartbeat_interval_ms"),
        (ElectionConfig("1", {"1": 1}, probe_interval_ms=0), "probe_interval_ms"),
    ],
)
def test_config_validation_names_the_problem(config: ElectionConfig, phrase: str) -> None:
    """A bad configuration is refused with a sentence naming what is wrong."""
    with pytest.raises(ElectionConfigError, match=phrase):
        config.validate()


def test_designated_primary_needs_two_nodes() -> None:
    """Designated primary is refused outside a two-node cluster."""
    election = make()
    ready = election.set_designated_primary(True, "alice", 1)
    assert ready.rejection is not None
    assert ready.rejection.code.status == "FAILED_PRECONDITION"
    assert "3 nodes, not two" in ready.rejection.message
    assert ready.persist is None
    assert not election.status().designated_primary


def test_designated_primary_refused_when_the_other_node_holds_it() -> None:
    """Once node 2 has said it is designated, node 1 refuses the flag (never both)."""
    election = make(priorities={"1": 1, "2": 2})
    election.step(PeerMessage("2", "1", AreYouCoordinator("2:a", 2, designated_primary=True)), 1)
    ready = election.set_designated_primary(True, "alice", 2)
    assert ready.rejection is not None
    assert "node 2 already holds it" in ready.rejection.message
    assert not election.persisted.designated_primary


def test_designated_primary_runs_alone_and_is_persisted_and_loud() -> None:
    """A designated primary forms a normal group alone; the flag is persisted and shown."""
    election = make(priorities={"1": 2, "2": 1})
    ready = election.set_designated_primary(True, "alice", 10)
    assert ready.persist is not None and ready.persist.designated_primary
    assert any(
        e.level is LogLevel.WARNING and "DESIGNATED PRIMARY SET by alice" in e.message
        for e in ready.events
    )
    assert election.status().designated_primary
    assert election.status().quorum_required == 1
    drain(election, 200)
    status = election.status()
    assert status.state is NodeState.NORMAL and status.role is Role.MASTER
    assert status.members == ("1",)
    # Clearing it drops the node out of the one-node group at the next tick.
    election.set_designated_primary(False, "alice", 300)
    assert election.status().state is NodeState.INACTIVE
    assert election.status().role is Role.INACTIVE


def test_quorum_override_lowers_the_count_and_survives_restart() -> None:
    """An override of 1 lets a lone node of three go normal; it is persisted and reported."""
    election = make()
    ready = election.set_quorum_override(1, "bob", 5)
    assert ready.persist is not None and ready.persist.quorum_override == 1
    assert any("QUORUM OVERRIDE SET by bob" in e.message for e in ready.events)
    drain(election, 200)
    assert election.status().state is NodeState.NORMAL
    assert election.status().quorum_override == 1
    restarted = make(persisted=election.persisted)
    assert restarted.status().quorum_override == 1
    assert restarted.status().quorum_required == 1
    bad = restarted.set_quorum_override(4, "bob", 10)
    assert bad.rejection is not None and "use 1 to 3" in bad.rejection.message


def test_priority_zero_never_invites() -> None:
    """A priority-0 node alone probes (to be found) but never invites; its invitations are
    refused by others."""
    election = make(node="1", priorities={"1": 0, "2": 1, "3": 1})
    for now in range(0, 2000, 50):
        ready = election.tick(now)
        assert not any(isinstance(m.body, Invitation | GroupReady) for m in ready.messages)
        ready = election.step(PeerMessage("2", "1", AreYouCoordinator(f"2:p{now}", 1)), now)
        assert not any(isinstance(m.body, Invitation) for m in ready.messages)
    other = make(node="2", priorities={"1": 0, "2": 1, "3": 1})
    ready = other.step(PeerMessage("1", "2", Invitation("1:x", 0, 0)), 1)
    assert ready.rejection is not None and "priority 0" in ready.rejection.message


def test_group_ids_come_from_the_injected_source() -> None:
    """Group names are `node:unique`, the unique part from the injected callable."""
    election = make()
    assert election.status().group_name == "1:g1"


def test_ready_docstring_states_the_order() -> None:
    """The driver contract (persist, send, role command) is written on the record."""
    doc = Ready.__doc__ or ""
    assert doc.index("persist") < doc.index("messages") < doc.index("role_command")


def run_cluster(priorities: dict[str, int], until_ms: int) -> Cluster:
    """A cluster started together and run for a while (helper for the checks below)."""
    cluster = Cluster(priorities)
    for node in priorities:
        cluster.start(node)
    cluster.run(until_ms)
    return cluster


def test_highest_priority_leads_and_everyone_agrees() -> None:
    """After startup the highest-priority node is master and every node is in its group."""
    cluster = run_cluster({"1": 1, "2": 5, "3": 3, "4": 5, "5": 0}, 1000)
    statuses = {n: e.status() for n, e in cluster.nodes.items() if e is not None}
    # Priorities 5 tie between 2 and 4: the lower id wins.
    assert {s.coordinator_id for s in statuses.values()} == {"2"}
    assert {s.state for s in statuses.values()} == {NodeState.NORMAL}
    assert statuses["2"].role is Role.MASTER
    assert len({s.group_name for s in statuses.values()}) == 1


def test_single_node_cluster_runs_alone() -> None:
    """A one-node cluster (deploy/single.toml) is its own majority and goes normal at once."""
    election = make(priorities={"1": 1})
    ready = election.tick(election.next_deadline_ms() or 0)
    assert ready.role_command is not None
    assert ready.role_command.kind is RoleCommandKind.MASTER
    assert ready.persist is not None and ready.persist.epoch == 1
    status = election.status()
    assert status.state is NodeState.NORMAL and status.members == ("1",)
    assert status.quorum_required == 1


def test_reports_older_than_the_last_command_are_not_used() -> None:
    """An invitation is answered only with a report read after the replica stopped."""
    election = make()  # node 1, replica reported after the start command (seq 1)
    election.step(PeerMessage("3", "1", Invitation("3:a", 3, 0)), 10)
    # Join, become a slave, then a newer coordinator invites: the replica must stop first.
    ready = election.step(PeerMessage("3", "1", GroupReady("3:a", 1, ("1", "3"), "3", "3", 2)), 11)
    assert ready.role_command is not None and ready.role_command.kind is RoleCommandKind.FOLLOW
    ready = election.step(PeerMessage("3", "1", Invitation("3:b", 3, 1)), 20)
    assert ready.role_command is not None
    assert ready.role_command.kind is RoleCommandKind.DEACTIVATE
    assert not any(isinstance(m.body, Accept) for m in ready.messages)
    stop_seq = ready.role_command.seq
    # A report read before the stop (older command seq), or while serving, is not enough.
    stale = election.replica_report(
        ReplicaReport("c1", 1, 7, StoreState.DIRTY, command_seq=stop_seq - 1), 21
    )
    serving = election.replica_report(
        ReplicaReport("c1", 1, 7, StoreState.DIRTY, active=True, command_seq=stop_seq), 22
    )
    assert not stale.messages and not serving.messages
    fresh = election.replica_report(
        ReplicaReport("c1", 1, 9, StoreState.DIRTY, command_seq=stop_seq), 23
    )
    accepts = [m.body for m in fresh.messages if isinstance(m.body, Accept)]
    assert accepts == [
        Accept("3:b", MemberReport("1", "c1", 1, 9, StoreState.DIRTY, max_seen=2, epoch=1))
    ]


def test_a_late_older_report_does_not_replace_the_stopped_state() -> None:
    """Regression (found by the simulator): a report read before the stop but delivered
    after the stopped one must not become the data the node answers invitations with."""
    counter = iter(range(1, 100))
    election = Election(
        ElectionConfig(node_id="1", priorities={"1": 1, "2": 2, "3": 3}),
        PersistedState(epoch=4, max_seen=3),
        lambda: f"g{next(counter)}",
    )
    start = election.tick(0)
    assert start.role_command is not None
    seq = start.role_command.seq
    election.replica_report(ReplicaReport("c1", 4, 9, StoreState.DIRTY, command_seq=seq), 1)
    election.replica_report(
        ReplicaReport("c1", 4, 5, StoreState.DIRTY, active=True, command_seq=seq - 1), 2
    )
    ready = election.step(PeerMessage("3", "1", Invitation("3:a", 3, 4)), 3)
    accepts = [m.body for m in ready.messages if isinstance(m.body, Accept)]
    assert [(a.report.last_epoch, a.report.last_lsn) for a in accepts] == [(4, 9)]


def test_an_invitation_or_ready_of_another_cluster_is_refused_naming_both_ids() -> None:
    """A node that knows its cluster never joins a group of another one."""
    election = Election(
        ElectionConfig(node_id="1", priorities={"1": 1, "2": 2, "3": 3}),
        PersistedState(epoch=2, max_seen=3, cluster_id="ours"),
        lambda: "g1",
    )
    election.tick(0)
    election.replica_report(ReplicaReport("ours", 2, 9, StoreState.DIRTY, command_seq=1), 0)
    before = election.status()
    for body in (
        Invitation("3:x", 3, 2, cluster_id="theirs"),
        GroupReady("3:x", 5, ("1", "3"), "3", "3", 3, cluster_id="theirs"),
    ):
        ready = election.step(PeerMessage("3", "1", body), 1)
        assert ready.rejection is not None
        assert ready.rejection.code.status == "FAILED_PRECONDITION"
        assert "'theirs'" in ready.rejection.message and "'ours'" in ready.rejection.message
        assert ready.persist is None and ready.role_command is None
        assert election.status() == before


def test_the_minted_cluster_id_comes_from_the_injected_source() -> None:
    """A single node's first formation mints through ``new_cluster_id`` and persists it."""
    election = Election(
        ElectionConfig(node_id="1", priorities={"1": 1}),
        PersistedState(),
        lambda: "g1",
        lambda: "minted-1",
    )
    first = election.tick(0)
    assert first.role_command is not None
    readies = [
        election.replica_report(
            ReplicaReport("", 0, 0, StoreState.EMPTY, command_seq=first.role_command.seq), 0
        ),
        election.tick(100),
    ]
    masters = [
        r.role_command
        for r in readies
        if r.role_command is not None and r.role_command.kind is RoleCommandKind.MASTER
    ]
    assert [m.cluster_id for m in masters] == ["minted-1"]
    assert election.persisted.cluster_id == "minted-1"


def test_a_catch_up_invitation_naming_a_node_below_the_inviter_is_refused() -> None:
    """Only nodes ranked above a serving inviter join to catch up; anything else is a bad
    message, refused with the rule, and changes nothing."""
    election = make("3")
    before = election.status()
    ready = election.step(PeerMessage("2", "3", Invitation("2:g9", 2, 1, catch_up=("1",))), 10)
    assert ready.rejection is not None
    assert ready.rejection.code is RejectCode.INVALID_MESSAGE
    assert "ranked above the inviter 2" in ready.rejection.message
    assert election.status() == before


def test_negative_slave_lags_are_refused() -> None:
    """A driver bug (a negative lag) is refused, not taken as caught up."""
    election = make("3")
    ready = election.slave_lags({"1": -1}, 10)
    assert ready.rejection is not None
    assert ready.rejection.code is RejectCode.INVALID_ARGUMENT
    assert not ready.hand_over_to


def _node_1_serving_with_node_3() -> tuple[Cluster, Election]:
    """Three nodes (priorities 3, 2, 1); node 2 crashed, so node 1 serves with node 3."""
    cluster: Cluster | None = None
    for line in ("cluster 1:3 2:2 3:1", "start 1 2 3", "run ms=400", "crash 2", "run ms=3000"):
        cluster, _ = execute(cluster, line)
    assert cluster is not None
    node1 = cluster.nodes["1"]
    assert node1 is not None and node1.status().members == ("1", "3")
    return cluster, node1


def test_a_change_the_coordinator_persisted_stays_in_progress_when_its_group_fails() -> None:
    """Node 2's machine is gone; node 1 (serving with node 3) replaces it. Node 3 persists
    the new epoch but is cut off before its ReadyAck reaches node 1, which already persisted
    the new set with its own vote and cannot go normal alone. The set is in force on node 1
    from then on (it wins the next merge as the newest), so the change is not "FAILED;
    nothing changed" (what the status said, found by the coordinated simulator's
    replace-node): it stays in progress, and is done when the group forms under it."""
    cluster, node1 = _node_1_serving_with_node_3()
    change = MembershipChange(
        ChangeKind.REPLACE, "2", coordinator_address="h2b:1", replica_address="h2b:2"
    )
    deliver = cluster.deliver
    dropped: list[PeerMessage] = []

    def cut_after_its_vote(message: PeerMessage) -> None:
        if message.from_node == "3" and isinstance(message.body, GroupReadyAck) and not dropped:
            cluster.cut.add(frozenset(("1", "3")))
            dropped.append(message)
            return
        deliver(message)

    cluster.deliver = cut_after_its_vote  # type: ignore[method-assign]
    cluster.apply("1", node1.change_membership(change, "operator", cluster.now_ms, ""), "change")
    cluster.run(3000)
    assert dropped, "node 3 never acknowledged a Ready"
    status = node1.status()
    assert status.membership is not None and status.membership.version == 1
    assert "2" in status.membership.learners  # the replacing machine, in force here
    note = status.membership_change
    assert "in progress (v1): persisted here" in note, note
    assert "nothing changed" not in note
    cluster.cut.clear()
    cluster.run(3000)
    status = node1.status()
    assert status.state is NodeState.NORMAL and status.members == ("1", "3")
    assert "done in epoch" in status.membership_change, status.membership_change


def test_a_node_that_missed_a_priority_0_change_invites_the_node_that_never_invites() -> None:
    """Node 3 is cut off while node 2 gets priority 0 (set-priority, v1). Then node 1 dies.
    Under node 3's old set node 2 ranks above it, so node 3 waited for node 2's invitation;
    under node 2's set it has priority 0 and never invites: each waited for the other for
    good (found by the coordinated simulator, seed 1615). Node 3 now invites a node on a
    newer set that says priority 0, as a member; node 2 judges it under its own set (node
    3 ranks above it there), and node 3 learns that set from node 2's answer."""
    cluster: Cluster | None = None
    for line in ("cluster 1:3 2:2 3:1", "start 1 2 3", "run ms=400"):
        cluster, _ = execute(cluster, line)
    assert cluster is not None
    cluster.cut.update({frozenset(("1", "3")), frozenset(("2", "3"))})
    cluster.run(2000)
    node1, node3 = cluster.nodes["1"], cluster.nodes["3"]
    assert node1 is not None and node3 is not None
    assert node1.status().members == ("1", "2")
    change = MembershipChange(ChangeKind.SET_PRIORITY, "2", priority=0)
    cluster.apply("1", node1.change_membership(change, "operator", cluster.now_ms, ""), "change")
    cluster.run(2000)
    assert "done in epoch" in node1.status().membership_change
    assert node3.membership.version == 0  # it missed the change
    for line in ("crash 1", "run ms=500"):
        cluster, _ = execute(cluster, line)
    cluster.cut.clear()
    cluster.run(5000)
    status = node3.status()
    assert status.state is NodeState.NORMAL, status
    assert status.coordinator_id == "3" and status.members == ("2", "3")
    assert node3.membership.version == 1 and node3.membership.priorities["2"] == 0


def test_a_node_whose_change_formed_no_group_joins_the_group_formed_under_the_older_set() -> None:
    """Node 1 (priority 3) lowers its own priority to 1 while it serves with node 3 (node
    2 down): it persists the new set with its vote, but node 3 is cut off before the
    Ready reaches it, so no group forms under it. Nodes 2 and 3 then form a group under the older
    set, which ranks node 1 first: node 2 invited it to catch up, and node 1, which its own
    set ranks below node 2, refused that as a bad message, again and again, each merge a
    new epoch (found by the coordinated simulator, seed 11432). It now joins as a member,
    the group takes its newer set, node 2 keeps the lead, and the epoch stays put."""
    cluster, node1 = _node_1_serving_with_node_3()
    deliver = cluster.deliver
    dropped: list[PeerMessage] = []

    def cut_before_the_ready(message: PeerMessage) -> None:
        if message.to_node == "3" and isinstance(message.body, GroupReady) and not dropped:
            cluster.cut.update({frozenset(("1", "3")), frozenset(("1", "2"))})
            dropped.append(message)
            return
        deliver(message)

    cluster.deliver = cut_before_the_ready  # type: ignore[method-assign]
    change = MembershipChange(ChangeKind.SET_PRIORITY, "1", priority=1)
    cluster.apply("1", node1.change_membership(change, "operator", cluster.now_ms, ""), "change")
    cluster.run(1000)
    assert dropped, "node 1 never sent node 3 a Ready"
    node3 = cluster.nodes["3"]
    assert node3 is not None and node3.membership.version == 0
    assert node1.membership.version == 1 and node1.membership.priorities["1"] == 1
    for line in ("start 2", "run ms=3000"):
        cluster, _ = execute(cluster, line)
    node2 = cluster.nodes["2"]
    assert node2 is not None
    status = node2.status()
    assert status.state is NodeState.NORMAL and status.members == ("2", "3"), status
    assert node2.membership.version == 0  # the group formed under the older set
    cluster.cut.clear()
    cluster.run(5000)
    status = node2.status()
    assert status.state is NodeState.NORMAL, status
    assert status.coordinator_id == "2" and status.members == ("1", "2", "3"), status
    for node in ("1", "2", "3"):
        election = cluster.nodes[node]
        assert election is not None
        assert election.membership.version == 1, node
        assert election.membership.priorities == {"1": 1, "2": 2, "3": 1}, node
    # Node 1 joined as one invited to catch up, but the group's set ranks it below node 2:
    # caught up, it is not handed the lead.
    ready = node2.slave_lags({"1": 0, "3": 0}, cluster.now_ms)
    assert ready.rejection is None and not ready.hand_over_to, ready
    epoch = node2.persisted.epoch
    cluster.run(5000)
    assert node2.persisted.epoch == epoch  # no merge after merge
    assert node2.status().members == ("1", "2", "3")


def _master_1_cut_off_while_2_and_3_serve() -> Cluster:
    """Node 1 leads epoch 1, is cut off while it appends an entry nobody copies, and nodes 2
    and 3 form epoch 2 without it (node 2 master); the cut is then healed."""
    cluster: Cluster | None = None
    for line in (
        "cluster 1:3 2:2 3:1",
        "start 1 2 3",
        "run ms=400",
        "write 1 n=4",
        "partition 1|2,3",
        "write 1 n=1",
        "run ms=1500",
        "heal",
    ):
        cluster, _ = execute(cluster, line)
    assert cluster is not None
    for node in ("2", "3"):
        election = cluster.nodes[node]
        assert election is not None
        status = election.status()
        assert (status.state, status.coordinator_id, status.epoch) == (NodeState.NORMAL, "2", 2)
    return cluster


def test_a_master_back_from_a_cut_on_stale_probe_answers_is_not_made_coordinator() -> None:
    """Chaos seed 80: node 1, the master, was cut off for 2.5 s and came back 130 ms before
    the others formed the next epoch. The answers to its probes predated that group, so it
    merged them as if nobody served, they took its invitation (it ranks first), and as the
    new master its replica truncated its deposed suffix (a replay of its whole log) and
    fetched while no master served: 1.7 s of refused writes on a small store, growing with
    the log. Now node 1 drops a candidate that a later answer says serves, and the
    serving group's nodes decline an invitation from a node behind their epoch that
    serves nothing: node 2 invites node 1 to catch up as a slave and keeps serving."""
    cluster = _master_1_cut_off_while_2_and_3_serve()
    node1, node2 = cluster.nodes["1"], cluster.nodes["2"]
    assert node1 is not None and node2 is not None
    # An answer node 2 gave before it formed its group reaches node 1 only now.
    stale = replace(node2._probe_reply(with_settings=False), serving=False)
    cluster.deliver(PeerMessage("2", "1", stale))
    masters: list[tuple[str, int]] = []
    apply = cluster.apply

    def record_masters(node: str, ready: Ready, heading: str, elide: bool = False) -> None:
        command = ready.role_command
        if command is not None and command.kind is RoleCommandKind.MASTER:
            masters.append((node, command.epoch))
        apply(node, ready, heading, elide)

    cluster.apply = record_masters  # type: ignore[method-assign]
    cluster.run(3000)
    # Node 1 never led with a sync source it had to fetch from: node 2 stayed the master
    # of every epoch until node 1, caught up, was handed the group.
    first_1 = next((i for i, (node, _) in enumerate(masters) if node == "1"), len(masters))
    assert first_1 > 0 and all(node == "2" for node, _ in masters[:first_1]), masters
    out = "\n".join(cluster.out)
    assert "to catch up, then take the group over" in out, out[-3000:]


def test_a_node_behind_takes_the_catch_up_invitation_while_its_own_merge_waits() -> None:
    """Chaos seed 86: node 1, back from a cut, invited node 2, which declined (node 1 is
    behind) and, having heard from node 1 just then, invited it to catch up at once. Node 1
    took catch-up invitations only when inactive, and was still waiting for the accept of
    its own merge, which never came: node 2's merge waited member_timeout_ms (1 s) for
    node 1 and formed without it, and in between no master served. A node whose own merge
    is still collecting takes the serving group's invitation to catch up: its merge would
    form nothing (the others decline it)."""
    cluster = _master_1_cut_off_while_2_and_3_serve()
    node1, node2 = cluster.nodes["1"], cluster.nodes["2"]
    assert node1 is not None and node2 is not None
    stale = replace(node2._probe_reply(with_settings=False), serving=False)
    cluster.deliver(PeerMessage("2", "1", stale))
    for _ in range(200):
        if node1.status().state is NodeState.ELECTION:
            break
        cluster.run(5)
    assert node1.status().state is NodeState.ELECTION, cluster.out[-20:]
    # Node 1's probe, sent as its merge began, reaches node 2 after the invitation.
    probe = AreYouCoordinator(
        node1._group,
        3,
        cluster_id=node1.persisted.cluster_id,
        settings_digest=node1._digest,
        membership_version=node1._membership.version,
        membership_epoch=node1._membership.epoch,
        base_digest=node1._base_digest,
    )
    cluster.deliver(PeerMessage("1", "2", probe))
    served: list[tuple[int, str]] = []
    apply = cluster.apply

    def record_roles(node: str, ready: Ready, heading: str, elide: bool = False) -> None:
        command = ready.role_command
        if node == "2" and command is not None:
            served.append((cluster.now_ms, command.kind.value))
        apply(node, ready, heading, elide)

    cluster.apply = record_roles  # type: ignore[method-assign]
    cluster.run(3000)
    out = "\n".join(cluster.out)
    assert "catch-up-accepted: node 1" in out, out[-3000:]
    # Node 2 stops serving for its catch-up merge and serves again within a few message
    # delays, not after a member timeout.
    stopped = next(t for t, kind in served if kind != RoleCommandKind.MASTER.value)
    again = next(t for t, kind in served if kind == RoleCommandKind.MASTER.value and t >= stopped)
    assert again - stopped < 100, (served, out[-3000:])


def test_a_member_declines_an_invitation_from_a_node_behind_its_serving_group() -> None:
    """The invitation itself, as node 3 (a member of node 2's group, epoch 2) hears it from
    node 1, whose epoch is 1: declined, naming why; node 3 stays in node 2's group. The
    same invitation forwarded by node 3's own coordinator would be taken."""
    cluster = _master_1_cut_off_while_2_and_3_serve()
    node1, node3 = cluster.nodes["1"], cluster.nodes["3"]
    assert node1 is not None and node3 is not None
    invitation = Invitation(
        "1:g9",
        3,
        node1.persisted.epoch,
        node1.persisted.cluster_id,
        settings_digest=node1._digest,
        base_digest=node1._base_digest,
    )
    ready = node3.step(PeerMessage("1", "3", invitation), cluster.now_ms)
    assert not ready.messages, ready.messages
    declined = [e.message for e in ready.events if e.event == "invitation-declined"]
    assert declined and "epoch 1, behind this node's 2" in declined[0], ready.events
    status = node3.status()
    assert (status.state, status.coordinator_id) == (NodeState.NORMAL, "2")
