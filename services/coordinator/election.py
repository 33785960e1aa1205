"""The coordinator's election and membership: Garcia-Molina's invitation election as IceStorm
runs it, written as a pure state machine.

Inputs are peer messages (``step``), clock ticks (``tick``), the local replica's state
(``replica_report``) and two operator controls; each returns one ``Ready`` record (state to
persist, messages to send, a role command for the local replica, log events). There is no
network, disk, clock, randomness or thread in here: the driver owns those, and the simulator
in tests/sim runs whole clusters of these machines from one seed.

The algorithm
-------------
* States are IceStorm's: INACTIVE, ELECTION, REORGANIZATION, NORMAL. A node starts, and
  returns after any error ("recovery"), as the coordinator of a group of its own, named
  ``node-id:unique-id`` like IceStorm's ``3:191131CC-...``; the unique part comes from the
  injected ``new_group_id`` callable.
* Rank: higher priority first, ties to the lower node id (numeric ids compare as numbers).
  Priority 0 nodes vote and replicate but never coordinate: they never invite (an invitation
  naming one is refused); while alone they probe, only to be found sooner.
* Coordinators in INACTIVE or NORMAL probe every other node every ``probe_interval_ms``
  (``AreYouCoordinator``). A positive reply, or a probe received, from a lower-ranked
  coordinator makes it a merge candidate; the merge runs after a collection window of
  ``merge_delay_ms_per_priority * (1 + steps)``, where ``steps`` counts the rank positions
  up to the highest coordinator seen above this node in the round: lower priorities wait
  longer, so the highest coordinator normally invites first. A merge invites the candidates
  and the node's current members into a fresh group (ELECTION). A node only ever invites
  nodes ranked below it.
* An invitation is accepted from a node ranked above the receiver's current coordinator (or
  from that coordinator itself), in any state, so membership only moves up the ranking
  until a failure. A coordinator that accepts forwards the invitation to its own members.
  The acceptor deactivates its replica and answers (``Accept``) with a report of its data
  taken after the replica stopped (the report's ``command_seq`` proves it).
* When every invitee has accepted, or ``member_timeout_ms`` has passed, the coordinator
  reorganizes. Short of the quorum (below) it does not scatter the group as IceStorm does:
  it holds the members, INACTIVE, and merges them with the next coordinator it finds, so a
  full startup that needs every node is not kept waiting by nodes rejoining one at a time.
  With the quorum it picks the group's epoch as one
  more than the highest epoch any member (itself included) has accepted and persists it,
  names the sync source (highest ``(last_epoch, last_lsn)``, the coordinator itself on a
  tie, then the lower node id) and sends ``Ready``. A member accepts only an epoch above its
  persisted one, persists it, goes NORMAL, tells its replica to follow, and acknowledges.
  The coordinator goes NORMAL (replica: master) when all members acknowledged, or at the
  deadline with those that did if they still make the quorum.
* Membership: members ask their coordinator ``AreYouThere`` every ``heartbeat_interval_ms``;
  no "yes" for ``member_timeout_ms``, or a "no", sends the member back to recovery. The
  coordinator counts those questions as its members' heartbeats: a member silent for
  ``member_timeout_ms`` is dropped, and a coordinator left below the quorum recovers.
  A coordinator that has just moved its group on (a merge of its own, or an invitation it
  accepted and forwarded) leaves the questions naming the old group from the members it
  invited unanswered for ``member_timeout_ms``: a "no" overtaking the invitation would send
  a member ranked above it (one that joined to catch up, or after a transfer) to recovery,
  and from there it refuses the invitation from below.
  A member that loses its coordinator does not wait for a probe round: see "Succession".
* Epochs: every node votes for an epoch at most once, by persisting it (the coordinator for
  its own group, members on ``Ready``), and a group goes NORMAL only with a quorum of votes,
  so two majority groups can never go NORMAL in the same epoch, and epochs never decrease,
  across restarts too.

Succession
----------
When a coordinator fails, its members recover (no "yes" for ``member_timeout_ms``, or its
``Leave``). Left to probes, each survivor would then form a group of its own, probe, and
the highest one would invite the others after a merge window: a probe round trip plus
``merge_delay_ms_per_priority`` (50 ms) spent after the last survivor noticed, about a
fifth of a node kill's publish gap. Instead:

* The highest-ranked eligible node of the lost group's view, less the failed coordinator
  (the successor), starts a merge at once when it recovers so (``_succeed``), inviting the
  view's other members; it needs no probe to know them, they were its group. The merge is
  the ordinary one: the same invitation, accept reports, quorum, epoch, sync source.
* A member that gets the successor's invitation while its own coordinator still answers
  it (its heartbeats run at another phase, so it notices up to a heartbeat later) does not
  accept: the rule that membership only moves up the ranking until a failure stands. It
  keeps the invitation for ``member_timeout_ms`` and takes it, through the ordinary
  checks, the moment it recovers from that group itself (timeout, ``Leave``, or its
  coordinator's "no"). If the coordinator never fails for it (a partial partition), the
  invitation lapses and the successor's merge times out short of the quorum, held
  INACTIVE until the ordinary probes merge it, as a recovered node would have been.
* The view is only as fresh as the group's ``Ready``: a member dropped since (dead) is
  still in it. So the successor probes its invitees too; any message from one proves it
  alive, and once a heartbeat interval has passed and the accepts make the quorum (then,
  or at a later accept: members notice the failure up to a heartbeat after the successor),
  the merge stops waiting for invitees it heard nothing from (``_prune_silent_invitees``)
  instead of waiting out ``member_timeout_ms``. A live invitee whose answer was slower is
  merged back in by the ordinary probes, in a new epoch.

Why this and not a shorter merge window: the window is there so the highest coordinator
invites first and merges do not collide; a successor is already the highest of the group
and invites nobody ranked above it, so it has nothing to wait for, while a window ending
when every probe is answered would still wait on the dead coordinator's probe. Safety is
untouched because only who invites and when changes: every group still needs the quorum's
accepts, persisted epochs only grow, the sync source is still the newest log, and a node
out of every group (quarantine, lost replica) neither succeeds nor takes an invitation.
What remains of a node kill's failover is detection: members notice a dead coordinator
``member_timeout_ms`` after its last answer, which came up to a heartbeat before the kill,
so 300-400 ms after it with the defaults (the second survivor's, which the new group
waits for, is on average the later of two such draws); only a shorter timeout, or another
signal than silence, would shorten that.

Quorum
------
A group goes NORMAL with a majority of all configured nodes. While no member of the group has
ever seen a majority together (``max_seen``, persisted, IceStorm's ``max``: the first full
system startup) it needs every configured node instead. IceStorm's own code asks for
``max == n``; Squall asks for ``max >= majority``, which is what matters once commits need
a majority. An operator can lower the count (``set_quorum_override``, for disaster recovery)
or, in a two-node cluster, let one node run alone (``set_designated_primary``); both are
persisted, logged as warnings and shown in ``status()``.

Rejoin behaviour
----------------
A restarted node of higher rank takes the leadership back, as in IceStorm, but only once it
has caught up. Its log may hold a suffix the running master lacks (it was killed as master
holding uncommitted entries): taking the lead at once would make it truncate (a replay of its
whole log) and fetch while no master serves, a publish gap that grows with the log. So:

1. Probes say whether their sender coordinates a NORMAL group (``serving``). A coordinator
   that serves no group does not merge a lower-ranked serving one; that group's coordinator,
   seeing the higher-ranked node alone, invites it as a member to catch up
   (``Invitation.catch_up`` names it), and it accepts although the inviter ranks below it.
   The group re-forms in a new epoch as for any rejoining node; the returning node is a
   slave, so its replica truncates and fetches from the master, which keeps serving.
   Probe answers can be older than the serving group (a master cut off for a moment comes
   back just before the others form the next epoch): so the serving group's nodes also
   decline an invitation from a node behind their epoch that serves nothing
   (``_declines_behind``), and their coordinator invites it to catch up. The node takes
   that invitation also while its own declined merge still waits for answers, which would
   otherwise keep the catch-up merge, and every write, waiting ``member_timeout_ms``.
2. The master's coordinator hears from its replica how far each streaming slave is behind
   (``slave_lags``, from every role renewal). Once the highest-ranked member that joined to
   catch up lags at most ``CATCH_UP_LAG_ENTRIES_MAX`` entries, it asks the driver to hand the
   group over (``Ready.hand_over_to``): the replica fences writes until the target holds the
   whole log, then ``transfer_leadership`` runs the ordinary transfer, and the returning node
   leads a new group in a new epoch, with nothing to fetch or truncate. A hand-over that
   fails is asked for again after ``2 * member_timeout_ms`` (the transfer's own limit), or
   at the first renewal once the group has re-formed: the transfer of a group that changed
   is refused, so nothing of the earlier one is under way.

The cost is two short re-formations (about ``merge_delay_ms_per_priority`` plus a few round
trips each) instead of one whose length grew with the log; the gain is a predictable master.
A restarted lower-ranked node also causes a re-formed group (new epoch), because it has to be
invited in. A coordinator that does not serve (INACTIVE, or held short of the quorum) still
merges lower-ranked coordinators at once, as before: nobody serves to catch up from.

Cluster identity and cold starts
--------------------------------
Every store belongs to one cluster. The coordinator of the first group to form from empty
stores mints the cluster id (the injected ``new_cluster_id``); it persists it with the
epoch and sends it in ``Ready``, and every member persists it before acknowledging, so a
node whose replica never took the role still knows its cluster, and no later group can
mint another. Role commands carry it to the replicas. Probes and invitations carry the
sender's cluster id: a node of another cluster is never merged (logged once per id, naming
both ids, with no re-invitation until its id changes), and an invitation from another
cluster is refused. When a group forms only from replicas restarted from disk (none
joined), ``lifecycle.decide_start`` checks the stores (clean, dirty, empty; shutdown ids);
a refused group is held, not formed, and every member learns why from its coordinator's
answers to its heartbeats.

Consistency at start: probes and invitations also carry the digest of the sender's agreed
settings (``ElectionConfig.agreed_settings``: cluster name, nodes, durability, the limits
that shape stored data; see ``agreement.py``). A node whose digest differs is treated like
a node of another cluster: never merged, its invitations refused, until its digest
matches. A probe answered to a node that differs carries the replier's values, so both
sides name each differing setting and both values, in the log (``config-mismatch``, once
per difference) and in ``status().config_mismatches``.

One fate per node
-----------------
A node is a coordinator and a replica; it is a member only while both answer. The driver
reports what it sees of its replica: ``replica_silent(since_ms)`` when a call to it failed
or is still outstanding (``since_ms``: its last answer), ``replica_answered`` when it
answers again. The machine decides: silent for ``replica_timeout_ms`` means the node leaves
its group at once, telling the group (``Leave``: its members recover, or its coordinator
drops it, without waiting out ``member_timeout_ms``), and stays out of every group as a
quarantined node does (no probes, no positive probe replies, invitations ignored) until
the replica answers again. Then it recovers into a group of its own, reads its replica's
state afresh and is merged back in a new epoch like any returning node, so the replica
never resumes an epoch it lost. A replica that answers while its store cannot write (a
stuck disk: its oldest write has run past ``timeouts.store_stall_timeout_ms``, which the
driver judges from the replica's answer) is reported the same way, with
``store_stalled=True`` and ``since_ms`` the stall's start, so the reasons name the disk;
its end (writes complete again) is ``replica_answered``. The reverse fault needs nothing
here: a replica whose coordinator is gone drops its role when its lease runs out.

A node out of every group for any reason answers an invitation with a ``Leave`` naming the
invited group, and the inviter's merge stops waiting for it: its coordinator lives, so the
merge hears from it and would not prune it as a dead invitee (``_prune_silent_invitees``).
A coordinator stopping in order says ``Leave`` too (``stopping``), and a coordinator that
drops the target of its transfer gives the transfer up (``Ready.transfer_dropped``).

A replica on oversubscribed CPUs answers late though it is well. The driver times its
role calls and passes the longest round trip of about the last two seconds with the
silence (``answer_ms``, ``answer_times.py``); the machine allows
``ANSWER_ALLOWANCE_FACTOR`` times that on top of ``replica_timeout_ms``, at most one
``replica_timeout_ms`` more (an adaptive timeout, as TCP's retransmission timer follows
the round trips it measures). A replica that answered quickly until it died, hung or was
paused is taken out a few tens of milliseconds after ``replica_timeout_ms``; a busy one
gets up to twice that.

Master refusals
---------------
A replica that refuses the master role makes its driver recover (a fresh Election); the
highest-ranked node would then lead and name its refusing replica again, for ever. After
``MASTER_REFUSALS_MAX`` refusals in a row the driver builds the fresh Election with a
``LeadHoldOff``: until it ends, the node is out of every group as a quarantined node is
(no probes, no positive probe replies, invitations ignored), so nobody hands it the lead
and the others elect a master; at its end (a timer: ``next_deadline_ms`` includes it) the
node probes and rejoins like a returning node (docs/operations.md, "A replica that refuses
the master role"). Only who takes part changes, so safety is untouched. The driver holds
a node off the same way when its master's replica has heard from no majority of the
group's replicas for too long (their links alone are cut, and the coordinators see
nothing wrong): ``LeadHoldOff.refusals`` is then 0 and its reason says so. And a node
whose replica keeps refusing the slave role (frozen for a cluster shutdown an operator's
command left unfinished, say) is held off the same way, so that its group is not
re-formed for it again and again (``LeadHoldOff.role`` is then "slave").

Membership changes
------------------
The config file is the bootstrap node set (``ElectionConfig.priorities``, version 0, or
the version and epoch an exported file records). ``change_membership`` (the coordinator of
the serving group only) checks one change (``membership.apply_change``: add, remove,
replace or re-prioritize one node; refusals name the reason), applies the new set in
memory and re-forms the group under it: invitations carry it (an invitee holding an older
set judges the invitation under it, so a node it does not know yet may invite it), the
group's ``Ready`` carries it with the new epoch, and every member persists it with the
epoch vote. While a change is in progress the group needs a majority of the old set and
of the new one; the change is done when the group goes NORMAL, and failed (the persisted
set stays in force) when it is held or recovers before this coordinator persisted the new
set. Once it has (its own epoch vote, with the Ready) the set is in force here and wins
the next merge as the newest, so the change stays in progress until a group of this
node's forms under it (or is handed on, noted as such, when this node joins another's
group). Single-server changes keep any majority of the old set and any of the new one
overlapping, so the epoch votes stay exclusive
(docs/replication.md, "Membership changes"). When groups form, the set of the newest group
among the members' reports wins (``_adopt_newest``), so a node that missed a change learns
it and a later group never goes back to an older set. Probes carry the set's (epoch,
version): nodes holding different sets compare their agreed settings without the node
set, and a node of the set that is held by a removed coordinator is invited directly. A
node on a newer set whose probe says its priority there is 0 never invites, while under
an older set it may rank above the prober, who would wait for it for good: the prober
invites it as a member, and learns the newer set from its answer. A
member the new set ranks above the coordinator takes the group once caught up (the rejoin
hand-over), so ``set-priority`` moves the leader. Messages from a node the set removed
are refused, logged once per node.

Time
----
Every input carries ``now_ms`` from the driver's monotonic clock; going backwards is a
driver bug and raises ``ElectionError``. ``next_deadline_ms()`` says when the next tick is
due; ticking more often is harmless.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from squall_server.common.loss_record import (
    LOSS_ACK_MESSAGE_ID,
    LOSS_ACKED_IDS_MAX,
    LOSS_MESSAGE_ID,
    LOSS_RECORDS_MAX,
    LossRecord,
)
from squall_server.coordinator.agreement import SettingDifference, differences, settings_digest
from squall_server.coordinator.lifecycle import decide_start
from squall_server.coordinator.membership import (
    OPERATOR_CHANGES,
    ChangeKind,
    ChangeRefused,
    Member,
    Membership,
    MembershipChange,
    apply_change,
    in_force,
    newest,
)
from squall_server.coordinator.messages import (
    AUDIT_RECORDS_MAX,
    Accept,
    AreYouCoordinator,
    AreYouCoordinatorReply,
    AreYouThere,
    AreYouThereReply,
    Body,
    ConfigMismatch,
    ElectionStatus,
    GroupReady,
    GroupReadyAck,
    Invitation,
    LeadershipTransfer,
    Leave,
    LogEvent,
    LogLevel,
    MemberReport,
    NodeState,
    OperatorRecord,
    PeerMessage,
    PersistedState,
    Ready,
    RejectCode,
    Rejection,
    ReplicaReport,
    Role,
    RoleCommand,
    RoleCommandKind,
    StepAside,
)

# The most nodes a cluster may configure: bounds every member table and message fan-out.
NODES_MAX = 64
_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ID_RULE = "1 to 64 characters from A-Z a-z 0-9 '_' '-'"
# Longest part of a peer-supplied string quoted in a log line.
_SHOWN_CHARS_MAX = 80
# Timer passes per input: a timer firing can make another due at the same instant
# (recovery schedules an immediate probe), but never more than a few in a row.
_TIMER_PASSES_MAX = 4
# A member that joined to catch up is caught up when its replica lags the master by at most
# this many entries: the hand-over's write fence then waits for the rest (a few batches),
# not for a catch-up.
CATCH_UP_LAG_ENTRIES_MAX = 256
# A silence after role calls that took up to A ms each is allowed this many times A on
# top of replica_timeout_ms (at most one replica_timeout_ms more). Measured on the 2-core
# VM, the longest round trip in two seconds was 10-39 ms under light load and 38-143 ms
# with the cluster saturated, where a renewal's answer arrived up to ~280 ms after its
# call while the replica was well: twice the longest keeps light-load detection within
# ~80 ms of the timeout and covers most of those.
ANSWER_ALLOWANCE_FACTOR = 2


@dataclass(frozen=True, slots=True)
class LeadHoldOff:
    """The driver's word that this node steps aside from leading until ``until_ms``
    (monotonic): its replica refused the master role ``refusals`` times in a row, the last
    time for ``reason`` (driver.py, ``MASTER_REFUSALS_MAX``)."""

    until_ms: int
    refusals: int  # 0: not refusals; the master's replica was cut off (reason says)
    reason: str
    role: Literal["master", "slave"] = "master"  # the role refused

    @property
    def why(self) -> str:
        """Why the node steps aside, in a phrase for the log."""
        if self.refusals:
            return (
                f"its replica refused the {self.role} role {self.refusals} times in a row "
                f"(last: {self.reason})"
            )
        return self.reason


class ElectionError(RuntimeError):
    """A driver bug: time going backwards, a re-entrant call, a bad group id source."""


class ElectionConfigError(ValueError):
    """The election configuration or persisted state is unusable; the message says why."""


def node_sort_key(node_id: str) -> tuple[int, int, str]:
    """Order node ids as an operator reads them: numeric ids by value, then the others."""
    if node_id.isdigit():
        return (0, int(node_id), node_id)
    return (1, 0, node_id)


def rank_order(priorities: Mapping[str, int]) -> list[str]:
    """Every node, best first: higher priority, then the lower node id (the election's rank)."""
    return sorted(priorities, key=lambda x: (-priorities[x], node_sort_key(x)))


def quorum_rule(
    n: int, group_max_seen: int, *, designated: bool = False, override: int = 0
) -> tuple[int, str]:
    """How many of ``n`` configured nodes a group needs to go normal, and why.

    A majority once some member has seen a majority together (``group_max_seen``), else
    all ``n`` (full startup); 1 for an effective designated primary of a two-node cluster;
    an operator's ``override`` only ever lowers the count.
    """
    majority = n // 2 + 1
    if group_max_seen >= majority:
        required, why = majority, f"a majority of {n}"
    else:
        required = n
        why = (
            f"all {n}: full startup, no member has seen a majority together (max {group_max_seen})"
        )
    if designated:
        required, why = 1, "1: designated primary of a two-node cluster"
    if 0 < override < required:
        required, why = override, f"{override}: operator quorum override"
    return required, why


def pick_sync_source(positions: Mapping[str, tuple[int, int]], first: str) -> str:
    """The node with the highest ``(last_epoch, last_lsn)``; on a tie ``first`` (the
    coordinator), then the lower node id. Empty if ``positions`` is empty."""
    order = [first, *sorted((x for x in positions if x != first), key=node_sort_key)]
    best = ""
    best_key = (-1, -1)
    for node in order:
        position = positions.get(node)
        if position is not None and position > best_key:
            best, best_key = node, position
    return best


def parse_group_name(name: str) -> tuple[str, str] | None:
    """Split ``coordinator-id:unique-id`` into its parts, or None if it is malformed."""
    coordinator, sep, unique = name.partition(":")
    if not sep or not _ID_RE.fullmatch(coordinator) or not _ID_RE.fullmatch(unique):
        return None
    return coordinator, unique


def _show(value: str) -> str:
    """Quote a peer-supplied string for a log line, cut short if it is long."""
    if len(value) <= _SHOWN_CHARS_MAX:
        return repr(value)
    return f"{value[:_SHOWN_CHARS_MAX]!r}... ({len(value)} characters)"


def _cut_off_why(whose: str, silent_ms: int, bound_ms: int) -> str:
    """Why a member is dropped under acks "group" (``cut_off_member``), for both logs."""
    return (
        f"the master's replica has heard nothing from {whose} replica for {silent_ms} ms "
        f'(at most {bound_ms}) and under acks "group" every commit waits for it: the links '
        "between the two replicas may be cut while the coordinators still reach each other"
    )


@dataclass(frozen=True)
class ElectionConfig:
    """This node's id, every configured node's priority, and the election's timing.

    The timing names match ``squall_server.common.config.TimeoutsConfig``; the driver copies
    them across. ``member_timeout_ms`` also bounds how long a coordinator waits for accepts
    and acknowledgements.
    """

    node_id: str
    priorities: Mapping[str, int]
    heartbeat_interval_ms: int = 100
    member_timeout_ms: int = 400
    probe_interval_ms: int = 200
    merge_delay_ms_per_priority: int = 50
    replica_timeout_ms: int = 300
    # The settings every member must share (ClusterConfig.agreed_settings): a node whose
    # digest differs is never merged. Empty compares nothing (tests that do not care).
    agreed_settings: tuple[tuple[str, str], ...] = ()
    # Each node's (coordinator, replica) address from the config file: the bootstrap node
    # set's addresses (a membership change checks new addresses against them).
    addresses: Mapping[str, tuple[str, str]] | None = None
    # The version and epoch of the node set the file lists: 0 for a file written by hand;
    # a file written by ``squall cluster config export`` records the running set's, so a
    # node started from it (a replacement, an added node) never takes an older set for
    # newer, such as the one a removed node still runs with.
    membership_version: int = 0
    membership_epoch: int = 0
    # The nodes the file marks as learners (an exported running set that had some).
    learners: frozenset[str] = frozenset()

    def bootstrap(self) -> Membership:
        """The config file's node set."""
        addresses = self.addresses or {}
        members = Membership.bootstrap(
            [
                Member(x, p, *addresses.get(x, ("", "")), learner=x in self.learners)
                for x, p in self.priorities.items()
            ]
        )
        return replace(members, version=self.membership_version, epoch=self.membership_epoch)

    def validate(self) -> None:
        """Raise ElectionConfigError with a sentence naming the first bad value."""
        if not 1 <= len(self.priorities) <= NODES_MAX:
            raise ElectionConfigError(
                f"priorities: {len(self.priorities)} nodes configured; a cluster has 1 to "
                f"{NODES_MAX} nodes"
            )
        for node, priority in self.priorities.items():
            if not _ID_RE.fullmatch(node):
                raise ElectionConfigError(f"priorities: node id {_show(node)} is not {_ID_RULE}")
            if priority < 0:
                raise ElectionConfigError(
                    f"priorities[{node}]: priority {priority} is negative; use 0 for a node "
                    "that never coordinates"
                )
        if self.node_id not in self.priorities:
            raise ElectionConfigError(
                f"node_id: {_show(self.node_id)} is not one of the configured nodes "
                f"{sorted(self.priorities, key=node_sort_key)}"
            )
        if all(priority == 0 for priority in self.priorities.values()):
            raise ElectionConfigError(
                "priorities: every node has priority 0, so none can coordinate"
            )
        for name in (
            "heartbeat_interval_ms",
            "member_timeout_ms",
            "probe_interval_ms",
            "replica_timeout_ms",
        ):
            if getattr(self, name) <= 0:
                raise ElectionConfigError(f"{name}: {getattr(self, name)} must be positive")
        if self.membership_version < 0 or self.membership_epoch < 0:
            raise ElectionConfigError(
                f"membership_version {self.membership_version} and membership_epoch "
                f"{self.membership_epoch} must not be negative"
            )
        if self.merge_delay_ms_per_priority < 0:
            raise ElectionConfigError(
                f"merge_delay_ms_per_priority: {self.merge_delay_ms_per_priority} is negative"
            )
        if self.member_timeout_ms < 2 * self.heartbeat_interval_ms:
            raise ElectionConfigError(
                f"member_timeout_ms: {self.member_timeout_ms} is less than twice "
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}); one lost heartbeat "
                "would break the group"
            )
        if self.replica_timeout_ms < 2 * self.heartbeat_interval_ms:
            raise ElectionConfigError(
                f"replica_timeout_ms: {self.replica_timeout_ms} is less than twice "
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}); one slow role renewal "
                "would take the node out of its group"
            )


@dataclass
class _Merge:
    """A coordinator collecting accepts for its new group (ELECTION).

    A successor's merge (``successor_of`` names the group whose coordinator failed) invites
    members known only from the old group's view, which may name a node that died
    unnoticed: from ``prune_at_ms`` on (``pruning``), once the accepts make the quorum, it
    stops waiting for invitees it has heard nothing from (``heard``: any message since the
    merge began). Not only at that instant: a member whose heartbeats run at a later phase
    than the successor's takes the invitation when it notices the failure itself, up to a
    heartbeat later, so the quorum may be made after ``prune_at_ms`` (chaos seed 92: an
    accept 103 ms after the invitation, then 900 ms more waiting for a cut-off invitee).
    """

    invited: set[str]
    expected: set[str]
    accepted: dict[str, MemberReport]
    deadline_ms: int
    successor_of: str = ""
    heard: set[str] = field(default_factory=set)
    prune_at_ms: int | None = None
    pruning: bool = False


@dataclass
class _Reorg:
    """A coordinator waiting for its members to persist the new epoch (REORGANIZATION)."""

    epoch: int
    members: tuple[str, ...]
    reports: dict[str, MemberReport]
    acked: set[str]
    deadline_ms: int
    next_resend_ms: int
    cluster_id: str = ""
    membership: Membership | None = None


@dataclass
class _Transfer:
    """A coordinator handing its group to ``target``; it gives up at ``deadline_ms``."""

    target: str
    deadline_ms: int


@dataclass
class _DeferredInvitation:
    """A successor's invitation a member got while its coordinator (ranked above the
    inviter) still answered it: taken if the member loses that coordinator too by
    ``until_ms`` (``_succeed``), forgotten otherwise."""

    frm: str
    body: Invitation
    until_ms: int


@dataclass
class _LeftGroup:
    """A group this node coordinated until it moved its members on: a merge of its own, or
    an invitation it accepted and forwarded to them (``invited``). Until ``until_ms`` their
    heartbeats naming it get no answer (``_on_are_you_there``)."""

    group_name: str
    invited: frozenset[str]
    until_ms: int


@dataclass
class _PendingAccept:
    """A member that accepted an invitation and waits for its replica's post-stop report."""

    group_name: str
    forwarded_to: tuple[str, ...]
    deadline_ms: int


@dataclass
class _Out:
    """The Ready record being built for one input."""

    persist: PersistedState | None = None
    messages: list[PeerMessage] = field(default_factory=list)
    role_command: RoleCommand | None = None
    events: list[LogEvent] = field(default_factory=list)
    rejection: Rejection | None = None
    hand_over_to: str = ""
    step_aside: str = ""
    transfer_dropped: str = ""


class Election:
    """One node's invitation-election state machine; see the module docstring."""

    def __init__(
        self,
        config: ElectionConfig,
        persisted: PersistedState,
        new_group_id: Callable[[], str],
        new_cluster_id: Callable[[], str] | None = None,
        *,
        wall_offset_ms: int = 0,
        lead_hold_off: LeadHoldOff | None = None,
    ) -> None:
        """Build the machine from config and the state persisted by earlier runs.

        ``new_group_id`` returns the unique part of each new group name (a uuid in
        production, a seeded or counted id in tests); it must never repeat for this node.
        ``new_cluster_id`` mints a cluster id at a first formation (a uuid in production);
        without it the id is made from the new group's name (unique the same way).
        ``wall_offset_ms`` turns ``now_ms`` into wall-clock time for operator records
        (the driver's wall clock minus its monotonic clock; 0 in tests).
        ``lead_hold_off``: the node starts out of every group until then (see "Master
        refusals" in the module docstring).
        """
        config.validate()
        self._bootstrap = config.bootstrap()
        membership = in_force(persisted.membership, self._bootstrap)
        if config.node_id not in membership.ids:
            raise ElectionConfigError(
                f"persisted state: node {config.node_id} is not in the node set it persisted "
                f"({membership.describe()}): it was removed from the cluster"
            )
        n = len(membership.voters)
        if persisted.epoch < 0 or persisted.max_seen < 0:
            raise ElectionConfigError(
                f"persisted state: epoch {persisted.epoch} and max_seen {persisted.max_seen} "
                "must not be negative"
            )
        if not 0 <= persisted.quorum_override <= n:
            raise ElectionConfigError(
                f"persisted state: quorum override {persisted.quorum_override} is outside "
                f"0..{n} for the {n} configured nodes; clear it with SetQuorumOverride(0)"
            )
        self._cfg = config
        self._me = config.node_id
        # The agreed settings without the node set: compared with a node that holds another
        # version of the set (the invitation brings it the newer one).
        self._base_settings = tuple(
            x for x in config.agreed_settings if not x[0].startswith("nodes.")
        )
        self._base_digest = settings_digest(self._base_settings)
        self._prio: dict[str, int] = {}
        # Learners of the set in force: members that count for no majority and never
        # coordinate until promoted (membership.py).
        self._learners: frozenset[str] = frozenset()
        # When a caught-up learner's promotion may be asked for again after one failed.
        self._promote_next_ms = 0
        # Nodes a membership change removed, as seen here: their messages are refused
        # quietly after one log line (they may run on until an operator stops them).
        self._removed: set[str] = set()
        self._removed_logged: set[str] = set()
        self._n = n
        self._majority = n // 2 + 1
        self._rank: dict[str, int] = {}
        self._others: tuple[str, ...] = ()
        self._eligible = False
        self._membership = membership
        self._settings = config.agreed_settings
        self._digest = settings_digest(config.agreed_settings)
        self._apply_membership(membership)
        # Membership change: the new set while this coordinator re-forms its group under it
        # (in force in memory, persisted with the new epoch), and what became of the last.
        self._proposal: MembershipChange | None = None
        self._proposed: Membership | None = None  # the set the change proposes
        self._membership_note = ""
        self._persisted = persisted
        self._new_group_id = new_group_id
        self._new_cluster_id = new_cluster_id
        self._wall_offset_ms = wall_offset_ms

        self._now_ms = 0
        self._started = False
        self._out: _Out | None = None
        self._state = NodeState.INACTIVE
        self._group = ""
        self._coord = self._me
        self._view: tuple[str, ...] = ()
        self._group_epoch = 0
        self._sync_source = ""
        self._members: dict[str, int] = {}
        self._role = Role.INACTIVE
        self._report: ReplicaReport | None = None
        self._report_fresh = False
        self._command_seq = 0
        self._merge: _Merge | None = None
        self._reorg: _Reorg | None = None
        self._pending: _PendingAccept | None = None
        self._next_probe_ms: int | None = None
        self._merge_at_ms: int | None = None
        self._merge_first_ms = 0
        self._candidates: set[str] = set()
        # Nodes on a newer node set that never invite (their priority 0 there): invited as
        # members whatever our set ranks them (_note_coordinator's never_invites).
        self._never_inviting: set[str] = set()
        self._higher_seen: str | None = None
        self._last_yes_ms = 0
        self._next_heartbeat_ms = 0
        # The other node's designated-primary flag as last heard, seeded from the persisted
        # state so a restart keeps refusing the flag while the peer was last seen holding it.
        self._peer_designated: dict[str, bool] = {
            node: True for node in persisted.peer_designated if node in self._prio
        }
        self._conflict_logged = False
        self._last_change_reason = "not started"
        # Nodes known to belong to another cluster (node -> its cluster id): never merged
        # until they report another id.
        self._foreign: dict[str, str] = {}
        # Consistency at start: the nodes refused because their agreed settings differ
        # (node -> (their digest, what differs)); ours are set by _apply_membership.
        self._disagree: dict[str, tuple[str, tuple[SettingDifference, ...]]] = {}
        # Coordinator: why the group is held instead of formed. Member: the last such
        # reason its coordinator gave.
        self._held_reason = ""
        self._held_note = ""
        self._transfer: _Transfer | None = None
        self._invited: tuple[str, ...] = ()
        # Member: a successor's invitation received while our coordinator still answered.
        self._deferred: _DeferredInvitation | None = None
        # Coordinator: the group it last moved its members on from, and whom it invited.
        self._left_group: _LeftGroup | None = None
        # One fate per node: since when the replica has not answered (None: it answers), and
        # whether that lasted replica_timeout_ms, so the node is out of every group.
        self._replica_silent_since: int | None = None
        self._replica_lost = False
        # The silence allowed on top of replica_timeout_ms for the replica's slow answers,
        # set when a silence begins (``_allowance_ms``).
        self._replica_allowance_ms = 0
        # Whether the silence is a replica that answers but whose store does not write.
        self._replica_store_stalled = False
        # Rejoin: higher-ranked nodes found alone while this node serves (invited at the next
        # merge), those invited to catch up (in the merge, then the view), and when a
        # hand-over to one may be asked for again in the group (epoch) it was asked in.
        self._catch_up_candidates: set[str] = set()
        self._catch_up: set[str] = set()
        # What each other coordinator last said in a probe or a probe's answer, and when:
        # does it serve (coordinate a NORMAL group)? (``_declines_behind``)
        self._heard_serving: dict[str, tuple[bool, int]] = {}
        self._hand_over_next_ms = 0
        self._hand_over_epoch = 0
        # Master refusals: out of every group until the hold-off ends (None: not held off).
        self._lead_hold_off = lead_hold_off

    # ----------------------------------------------------------------- public inputs

    def tick(self, now_ms: int) -> Ready:
        """Advance the clock; fires due probes, heartbeats, merges and timeouts."""
        return self._run(now_ms, lambda: None)

    def step(self, msg: PeerMessage, now_ms: int) -> Ready:
        """Handle one peer message; bad input is refused in ``Ready.rejection``."""
        return self._run(now_ms, lambda: self._on_message(msg))

    def replica_report(self, report: ReplicaReport, now_ms: int) -> Ready:
        """Take the local replica's (cluster_id, last_epoch, last_lsn, store_state)."""
        return self._run(now_ms, lambda: self._on_report(report))

    def replica_silent(
        self, since_ms: int, now_ms: int, *, store_stalled: bool = False, answer_ms: int = 0
    ) -> Ready:
        """The driver saw no answer from its replica since ``since_ms`` (its last answer): a
        call failed or is still outstanding. After ``replica_timeout_ms`` of that (plus the
        allowance for ``answer_ms``) the node leaves its group; ``replica_answered`` ends
        it. Repeating it is harmless.

        store_stalled: the replica answers, but its store has not completed a write since
        ``since_ms`` for longer than the driver's ``store_stall_timeout_ms`` (a stuck disk);
        it counts as silence, and the reasons say so. answer_ms: the longest its recent
        answers to role calls took (module doc, "One fate per node")."""
        return self._run(
            now_ms, lambda: self._on_replica_silent(since_ms, store_stalled, answer_ms)
        )

    def replica_answered(self, now_ms: int) -> Ready:
        """The replica answered a call again; a node out of its group for it rejoins."""
        return self._run(now_ms, self._on_replica_answered)

    def cut_off_member(self, node: str, silent_ms: int, bound_ms: int, now_ms: int) -> Ready:
        """The master's replica has heard nothing from member ``node``'s replica for too
        long while every commit waits for it (acks ``group``; the driver judges): drop it
        from the group as if it had left, and tell it to step aside (``StepAside``), so it
        stays out of every group for a while instead of being merged back at once. Only
        the coordinator of a NORMAL group acts; anyone else ignores it."""
        return self._run(now_ms, lambda: self._on_cut_off_member(node, silent_ms, bound_ms))

    def slave_lags(self, lags: Mapping[str, int], now_ms: int) -> Ready:
        """The master's replica's streaming slaves and how many entries each lacks, as its
        answer to a role renewal says. A member that joined to catch up and lags at most
        ``CATCH_UP_LAG_ENTRIES_MAX`` gets the group (``Ready.hand_over_to``)."""
        return self._run(now_ms, lambda: self._on_slave_lags(lags))

    def set_designated_primary(self, enabled: bool, operator: str, now_ms: int) -> Ready:
        """Mark (or clear) this node as the designated primary of a two-node cluster."""
        return self._run(now_ms, lambda: self._on_designated_primary(enabled, operator))

    def set_quorum_override(
        self, required: int, operator: str, now_ms: int, reason: str = ""
    ) -> Ready:
        """Lower the count of nodes a group needs to go normal; 0 clears the override.

        The override clears itself once this node is in a normal group with a majority
        of the configured nodes (the nodes are back; it is no longer needed).
        """
        return self._run(now_ms, lambda: self._on_quorum_override(required, operator, reason))

    def transfer_leadership(
        self, target: str, operator: str, now_ms: int, reason: str = ""
    ) -> Ready:
        """Hand this coordinator's group to ``target`` (see ``transfer_refusal``).

        The driver calls it only once its replica stopped taking writes and ``target``
        holds the whole log. The target then invites the group into a group of its own,
        which the members accept although it ranks below this node; the new group forms
        in a new epoch as any other. The target leads until the next election.
        """
        return self._run(now_ms, lambda: self._on_transfer_request(target, operator, reason))

    def transfer_refusal(self, target: str) -> Rejection | None:
        """Why a transfer to ``target`` cannot start now, or None; changes nothing."""
        if target not in self._prio:
            return Rejection(
                RejectCode.INVALID_ARGUMENT,
                f"node {self._me}: transfer to {_show(target)} refused: not a configured node "
                f"{sorted(self._prio, key=node_sort_key)}",
            )
        if self._coord != self._me or self._state is not NodeState.NORMAL:
            return Rejection(
                RejectCode.FAILED_PRECONDITION,
                f"node {self._me}: transfer to {target} refused: this node is not the master "
                f"(state {self._state.value}, coordinator {self._coord})",
            )
        if target == self._me:
            return Rejection(
                RejectCode.FAILED_PRECONDITION,
                f"node {self._me}: transfer refused: node {target} already leads "
                f"{self._group} in epoch {self._group_epoch}",
            )
        if self._transfer is not None:
            return Rejection(
                RejectCode.FAILED_PRECONDITION,
                f"node {self._me}: transfer to {target} refused: a transfer to "
                f"{self._transfer.target} is in progress",
            )
        if self._prio[target] == 0:
            return Rejection(
                RejectCode.FAILED_PRECONDITION,
                f"node {self._me}: transfer to {target} refused: it has priority 0 and never leads",
            )
        if target not in self._view:
            return Rejection(
                RejectCode.FAILED_PRECONDITION,
                f"node {self._me}: transfer to {target} refused: it is not a member of "
                f"{self._group} (members {','.join(self._view)})",
            )
        return None

    def change_membership(
        self, change: MembershipChange, operator: str, now_ms: int, reason: str = ""
    ) -> Ready:
        """Add, remove, re-address or re-prioritize one node (the coordinator of the serving
        group only; refused with the reason in ``Ready.rejection`` when unsafe).

        The coordinator re-forms its group under the new set: the ``Ready`` of the new
        epoch carries it and every member persists it with the epoch. The change is done
        when that group goes normal with a majority of the old set and of the new one;
        ``status().membership_change`` says where it stands.
        """
        return self._run(now_ms, lambda: self._on_membership_change(change, operator, reason))

    def replica_fault(self, fault_id: str, reason: str, now_ms: int) -> Ready:
        """The replica reported a fault (checksum error, failing disk): quarantine this node,
        unless an operator already cleared that very fault."""
        return self._run(now_ms, lambda: self._on_replica_fault(fault_id, reason))

    def set_quarantine(self, enabled: bool, operator: str, now_ms: int, reason: str = "") -> Ready:
        """Quarantine this node (operator), or clear its quarantine.

        A quarantined node takes no part in any group: it never leads, its replica never
        serves a role, so it is never counted for acks or for the quorum.
        """
        return self._run(now_ms, lambda: self._on_set_quarantine(enabled, operator, reason))

    def stopping(self, reason: str, now_ms: int) -> Ready:
        """This node's coordinator is stopping in order (SIGTERM): tell its group that it
        leaves, as a quarantine does, instead of leaving it to notice the silence after
        member_timeout_ms. The node takes no input after this (``CoordinatorNode.quiesce``).
        Chaos seed 97: a member caught up behind the group's coordinator was stopped, and
        88 ms later the coordinator handed it the group, froze writes for the hand-over and
        waited for a take-over that could not come (2.1 s without an acknowledgement)."""
        return self._run(now_ms, lambda: self._on_stopping(reason))

    def replica_losses(self, losses: tuple[LossRecord, ...], now_ms: int) -> Ready:
        """The replica reports the loss reports beside its store: keep each new one (not
        held, not acknowledged) until an operator acknowledges it."""
        return self._run(now_ms, lambda: self._on_replica_losses(losses))

    def ack_loss(self, loss_id: str, operator: str, now_ms: int, reason: str = "") -> Ready:
        """An operator acknowledges a loss report (audited); NOT_FOUND for an id this node
        does not hold, and nothing changes then."""
        return self._run(now_ms, lambda: self._on_ack_loss(loss_id, operator, reason))

    # ----------------------------------------------------------------- queries

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._me

    @property
    def membership(self) -> Membership:
        """The node set in force here (the config file's until a change)."""
        return self._membership

    @property
    def persisted(self) -> PersistedState:
        """The state the driver has been told to persist, as of the last input."""
        return self._persisted

    def status(self) -> ElectionStatus:
        """This node's view (IceStorm's ``replica`` table row plus epoch, role, quorum)."""
        if self._coord == self._me:
            if self._state is NodeState.NORMAL:
                group = tuple(x for x in self._view if x != self._me)
            elif self._state is NodeState.INACTIVE:
                group = tuple(sorted(self._members, key=node_sort_key))
            elif self._merge is not None:
                group = tuple(sorted(self._merge.accepted, key=node_sort_key))
            elif self._reorg is not None:
                group = tuple(x for x in self._reorg.members if x != self._me)
            else:
                group = ()
        else:
            group = ()
        return ElectionStatus(
            node_id=self._me,
            coordinator_id=self._coord,
            group_name=self._group,
            state=self._state,
            group=group,
            max_seen=self._persisted.max_seen,
            epoch=self._persisted.epoch,
            role=self._role,
            last_change_reason=self._last_change_reason,
            priority=self._prio[self._me],
            designated_primary=self._persisted.designated_primary,
            quorum_override=self._persisted.quorum_override,
            quorum_required=self._quorum(self._persisted.max_seen)[0],
            members=self._view if self._state is NodeState.NORMAL else (),
            quorum_override_record=self._persisted.quorum_override_record,
            quarantine=self._persisted.quarantine,
            audit=self._persisted.audit,
            invited=self._invited if self._coord == self._me else (),
            sync_source_id=self._sync_source if self._state is NodeState.NORMAL else "",
            transfer_target=self._transfer.target if self._transfer is not None else "",
            replica_unreachable_since_ms=(
                self._replica_silent_since + self._wall_offset_ms
                if self._replica_lost and self._replica_silent_since is not None
                else None
            ),
            lead_held_off_until_ms=(
                self._lead_hold_off.until_ms + self._wall_offset_ms
                if self._lead_hold_off is not None
                else None
            ),
            lead_held_off_reason=(
                self._lead_hold_off.why if self._lead_hold_off is not None else ""
            ),
            config_mismatches=tuple(
                ConfigMismatch(node, d.key, d.local_value, d.peer_value)
                for node in sorted(self._disagree, key=node_sort_key)
                for d in self._disagree[node][1]
            ),
            losses=self._persisted.losses,
            membership=self._membership,
            membership_change=self._membership_note,
        )

    def next_deadline_ms(self) -> int | None:
        """The earliest time a tick has work to do (None before the first input)."""
        if not self._started:
            return None
        due: list[int] = []
        if self._lead_hold_off is not None:
            due.append(self._lead_hold_off.until_ms)
        if self._replica_silent_since is not None and not self._replica_lost:
            due.append(
                self._replica_silent_since
                + self._cfg.replica_timeout_ms
                + self._replica_allowance_ms
            )
        if self._coord != self._me:
            if self._pending is not None:
                due.append(self._pending.deadline_ms)
            else:
                due.append(self._last_yes_ms + self._cfg.member_timeout_ms + 1)
                due.append(self._next_heartbeat_ms)
        else:
            if self._merge is not None:
                due.append(self._merge.deadline_ms)
                if self._merge.prune_at_ms is not None:
                    due.append(self._merge.prune_at_ms)
            if self._transfer is not None:
                due.append(self._transfer.deadline_ms)
            if self._reorg is not None:
                due.append(self._reorg.deadline_ms)
                due.append(self._reorg.next_resend_ms)
            if self._state in (NodeState.NORMAL, NodeState.INACTIVE) and self._members:
                due.append(min(self._members.values()) + self._cfg.member_timeout_ms + 1)
            if self._can_probe() and not self._waiting_for_report():
                if self._merge_at_ms is not None and self._can_merge():
                    due.append(self._merge_at_ms)
                if self._next_probe_ms is not None:
                    due.append(self._next_probe_ms)
        return min(due) if due else None

    # ----------------------------------------------------------------- plumbing

    def _run(self, now_ms: int, handler: Callable[[], None]) -> Ready:
        """Run one input: advance time, start if needed, handle, fire due timers."""
        if self._out is not None:
            raise ElectionError("Election inputs must not be re-entered")
        if now_ms < self._now_ms:
            raise ElectionError(
                f"now_ms went backwards from {self._now_ms} to {now_ms}; use a monotonic clock"
            )
        self._now_ms = now_ms
        before = self._view_key()
        out = _Out()
        self._out = out
        try:
            if not self._started:
                self._start()
            handler()
            if out.rejection is None:
                for _ in range(_TIMER_PASSES_MAX):
                    if not self._fire_timers():
                        break
        finally:
            self._out = None
        return Ready(
            persist=out.persist,
            messages=tuple(out.messages),
            role_command=out.role_command,
            view_changed=before != self._view_key(),
            events=tuple(out.events),
            rejection=out.rejection,
            hand_over_to=out.hand_over_to,
            step_aside=out.step_aside,
            transfer_dropped=out.transfer_dropped,
        )

    def _o(self) -> _Out:
        """The record under construction (only valid inside an input)."""
        if self._out is None:
            raise ElectionError("no input in progress")
        return self._out

    def _view_key(self) -> tuple[object, ...]:
        """What watchers of the group view care about."""
        return (
            self._state,
            self._group,
            self._coord,
            self._group_epoch,
            self._view,
            self._role,
            self._persisted,
        )

    def _send(self, to: str, body: Body) -> None:
        """Queue one message."""
        self._o().messages.append(PeerMessage(from_node=self._me, to_node=to, body=body))

    def _log(self, level: LogLevel, event: str, message: str) -> None:
        """Queue one log event; every line names this node."""
        self._o().events.append(LogEvent(level, event, f"node {self._me}: {message}"))

    def _reject(self, code: RejectCode, message: str) -> None:
        """Refuse the current input; the caller must return without changing anything."""
        self._o().rejection = Rejection(code, f"node {self._me}: {message}")
        self._log(LogLevel.WARNING, f"rejected-{code.value}", message)

    def _persist(self, **changes: object) -> None:
        """Record new persisted state; epochs and max_seen only grow."""
        new = replace(self._persisted, **changes)  # type: ignore[arg-type]
        if new.epoch < self._persisted.epoch or new.max_seen < self._persisted.max_seen:
            raise ElectionError(f"persisted state would go back from {self._persisted} to {new}")
        if new != self._persisted:
            self._persisted = new
            self._o().persist = new

    def _command(self, kind: RoleCommandKind, **fields: object) -> None:
        """Emit a role command; the replica's reports are stale until it reports again."""
        self._command_seq += 1
        cmd = RoleCommand(kind=kind, seq=self._command_seq, **fields)  # type: ignore[arg-type]
        self._o().role_command = cmd
        self._role = {
            RoleCommandKind.MASTER: Role.MASTER,
            RoleCommandKind.FOLLOW: Role.SLAVE,
            RoleCommandKind.DEACTIVATE: Role.INACTIVE,
        }[kind]
        self._report_fresh = False

    def _deactivate_if_active(self) -> None:
        """Stop the replica serving, unless it already stopped."""
        if self._role is not Role.INACTIVE:
            self._command(RoleCommandKind.DEACTIVATE)

    def _apply_membership(self, membership: Membership) -> None:
        """Use ``membership`` (in memory): priorities, ranks, the majority and the agreed
        settings follow it. Persisting it is the caller's business."""
        gone = set(self._prio) - set(membership.ids)
        self._removed = (self._removed | gone) - set(membership.ids)
        self._membership = membership
        self._learners = frozenset(membership.learners)
        # A learner ranks as priority 0 until promoted: it is invited, never invites.
        self._prio = {x: 0 if x in self._learners else p for x, p in membership.priorities.items()}
        n = len(membership.voters)
        self._n = n
        self._majority = n // 2 + 1
        # Higher is better; a rank is a position, so merge delays do not depend on the
        # spacing of configured priority values.
        self._rank = {node: len(self._prio) - i for i, node in enumerate(rank_order(self._prio))}
        self._others = tuple(sorted((x for x in self._prio if x != self._me), key=node_sort_key))
        self._eligible = self._prio.get(self._me, 0) > 0
        if membership.version == 0:
            self._settings = self._cfg.agreed_settings
        elif self._cfg.agreed_settings:
            self._settings = self._base_settings + membership.settings()
        else:
            self._settings = ()
        self._digest = settings_digest(self._settings)

    def _voters_in(self, nodes: Collection[str]) -> int:
        """How many of ``nodes`` vote (learners count for no majority)."""
        return sum(1 for x in nodes if x not in self._learners)

    def _set_key(self) -> tuple[int, int]:
        """(epoch, version) of the set in force: how probes tell sets apart."""
        return (self._membership.epoch, self._membership.version)

    def _rank_of(self, node: str) -> int:
        """A node's rank (higher is better); 0 for a node outside the set in force (one a
        membership change removed), below every member."""
        return self._rank.get(node, 0)

    def _wire_membership(self) -> Membership | None:
        """The node set messages carry: None while it is the config file's."""
        return self._membership if self._membership.version else None

    def _is_newer(self, membership: Membership | None) -> bool:
        """Is ``membership`` newer than the set in force here?"""
        if membership is None:
            return False
        mine = self._membership
        return (membership.epoch, membership.version) > (mine.epoch, mine.version)

    def _abandon_proposal(self, why: str, *, pending_if_persisted: bool = False) -> None:
        """The group under the change's new set did not form (``why``): back to the
        persisted set. If that is the new set (this node persisted it with its epoch vote
        when it sent the Ready), the change is not undone: with ``pending_if_persisted``
        (this node stays its own coordinator) it stays in progress and is done when a group
        of this node's forms under it; otherwise (a newer set, another coordinator's group)
        the note says the set is persisted here, not that nothing changed."""
        change = self._proposal
        if change is None:
            return
        persisted = in_force(self._persisted.membership, self._bootstrap)
        proposed = self._proposed
        if proposed is not None and (persisted.version, persisted.members) == (
            proposed.version,
            proposed.members,
        ):
            if pending_if_persisted:
                self._membership_note = (
                    f"{change.describe()}: in progress (v{proposed.version}): persisted "
                    f"here in epoch {persisted.epoch}; no group has formed under it yet ({why})"
                )
                self._log(
                    LogLevel.WARNING,
                    "membership-change-pending",
                    f"membership change {change.describe()}: the group under node set "
                    f"{persisted.describe()} did not form: {why}; the set is persisted here, "
                    "so the change stays in progress until a group forms under it",
                )
                return
            self._proposal = None
            self._membership_note = (
                f"{change.describe()}: not finished here ({why}); node set "
                f"v{proposed.version} is persisted on this node (epoch "
                f"{persisted.epoch}), so the group that forms takes it or a newer one (see "
                "squall status)"
            )
            self._log(
                LogLevel.WARNING,
                "membership-change-handed-on",
                f"membership change {change.describe()} not finished here: {why}; node set "
                f"{persisted.describe()} is persisted on this node",
            )
            return
        self._proposal = None
        self._membership_note = f"{change.describe()}: FAILED ({why}); nothing changed"
        self._log(
            LogLevel.WARNING,
            "membership-change-failed",
            f"membership change {change.describe()} failed: {why}; the node set stays "
            f"{persisted.describe()}",
        )

    def _record(self, operator: str, action: str, reason: str) -> OperatorRecord:
        """An operator record stamped now; also appended to the persisted audit trail."""
        record = OperatorRecord(self._now_ms + self._wall_offset_ms, operator, action, reason)
        audit = (*self._persisted.audit, record)[-AUDIT_RECORDS_MAX:]
        self._persist(audit=audit)
        return record

    def _make_group_name(self) -> str:
        """A fresh ``node-id:unique-id`` group name."""
        unique = self._new_group_id()
        if not _ID_RE.fullmatch(unique):
            raise ElectionError(f"new_group_id returned {_show(unique)}, not {_ID_RULE}")
        return f"{self._me}:{unique}"

    def _start(self) -> None:
        """First input: form a group of our own and stop whatever the replica was doing."""
        self._started = True
        self._group = self._make_group_name()
        # The replica may still serve a role from before a coordinator restart.
        self._command(RoleCommandKind.DEACTIVATE)
        self._next_probe_ms = self._now_ms
        self._last_change_reason = "started"
        p = self._persisted
        self._log(
            LogLevel.INFO,
            "start",
            f"starting in own group {self._group}; priority {self._prio[self._me]}, "
            f"epoch {p.epoch}, max {p.max_seen}",
        )
        if p.designated_primary:
            self._log(
                LogLevel.WARNING,
                "operator-designated-primary",
                "this node is the DESIGNATED PRIMARY (persisted): it runs alone when the "
                "other node is unreachable",
            )
        if p.quorum_override:
            self._log(
                LogLevel.WARNING,
                "operator-quorum-override",
                f"QUORUM OVERRIDE in force (persisted): groups need {p.quorum_override} "
                f"of {self._n} nodes",
            )
        hold_off = self._lead_hold_off
        if hold_off is not None:
            aside = "its group" if hold_off.role == "slave" else "leading"
            self._last_change_reason = (
                f"steps aside from {aside} for {hold_off.until_ms - self._now_ms} ms: "
                f"{hold_off.why}"
            )
        if p.quarantine is not None:
            self._log(
                LogLevel.WARNING,
                "quarantine",
                f"QUARANTINED (persisted) since {p.quarantine.at_ms} by "
                f"{p.quarantine.operator}: {p.quarantine.reason}; this node takes no part "
                "until an operator clears it",
            )

    # ----------------------------------------------------------------- rules

    def _can_probe(self) -> bool:
        """May this node send probes now?

        Priority-0 nodes probe too while alone, though they never merge: a probe tells the
        coordinators above that a node is waiting to be invited, so a node that recovered
        just after their own probe round is not left out until the next one.
        """
        if self._coord != self._me or self._out_of_groups():
            return False
        if self._state is NodeState.INACTIVE:
            return True
        return self._state is NodeState.NORMAL and self._eligible

    def _can_merge(self) -> bool:
        """May this node look for and invite other groups now? Not while it hands its
        group over: a new merge would make a new group under the transfer."""
        return (
            self._eligible
            and self._coord == self._me
            and self._state in (NodeState.INACTIVE, NodeState.NORMAL)
            and self._transfer is None
            and not self._out_of_groups()
        )

    def _quarantined(self) -> bool:
        """A quarantined node is in no group until an operator clears it."""
        return self._persisted.quarantine is not None

    def _out_of_groups(self) -> bool:
        """Quarantined, its replica is unreachable, or it steps aside after its replica kept
        refusing the master role: the node takes no part in any group."""
        return self._replica_lost or self._quarantined() or self._lead_hold_off is not None

    def _out_of_groups_why(self) -> str:
        """Why ``_out_of_groups``, in a phrase for the log."""
        if self._replica_lost:
            return "its replica is unreachable"
        if self._quarantined():
            return "it is quarantined"
        return "it steps aside after its replica kept refusing the master role"

    def _waiting_for_report(self) -> bool:
        """An idle coordinator without its replica's stopped state cannot lead a merge: it
        could not name a sync source. Its probes and merges wait for ``replica_report``."""
        return self._state is NodeState.INACTIVE and not self._report_fresh

    def _serving(self) -> bool:
        """Does this node coordinate a NORMAL group (its master takes writes)?"""
        return (
            self._coord == self._me
            and self._state is NodeState.NORMAL
            and not self._out_of_groups()
        )

    def _answers_as_coordinator(self) -> bool:
        """Is this node a coordinator another may merge (IceStorm's areYouCoordinator)?"""
        if self._coord != self._me or self._out_of_groups():
            return False
        if self._state is NodeState.NORMAL:
            return True
        return self._state is NodeState.INACTIVE and self._report_fresh

    def _designated_effective(self) -> bool:
        """Does the designated-primary flag let this node run alone right now?"""
        return (
            self._n == 2
            and self._eligible
            and self._persisted.designated_primary
            # A lower-ranked peer that holds the flag too gives it up when the two meet
            # (_learn_designation), so only a higher-ranked holder stops this node.
            and not any(
                flag and self._rank_of(node) > self._rank_of(self._me)
                for node, flag in self._peer_designated.items()
            )
        )

    def _quorum(self, group_max_seen: int) -> tuple[int, str]:
        """Nodes a group needs to go normal, and why (``quorum_rule``)."""
        return quorum_rule(
            self._n,
            group_max_seen,
            designated=self._designated_effective(),
            override=self._persisted.quorum_override,
        )

    def _merge_delay_ms(self) -> int:
        """Collection window before a merge: longer the further below a seen coordinator."""
        steps = 0
        if self._higher_seen is not None:
            steps = self._rank_of(self._higher_seen) - self._rank_of(self._me)
        return self._cfg.merge_delay_ms_per_priority * (1 + steps)

    def _my_report(self) -> MemberReport:
        """This node's member report; only called with a replica report in hand."""
        r = self._report
        if r is None:
            raise ElectionError("no replica report")
        return MemberReport(
            node_id=self._me,
            cluster_id=self._cluster_id(),
            last_epoch=r.last_epoch,
            last_lsn=r.last_lsn,
            store_state=r.store_state,
            max_seen=self._persisted.max_seen,
            epoch=self._persisted.epoch,
            shutdown_id=r.shutdown_id,
            joined=r.joined,
            membership=self._persisted.membership,
        )

    def _cluster_id(self) -> str:
        """The cluster this node belongs to: its store's, else the one it persisted."""
        stored = self._report.cluster_id if self._report is not None else ""
        return stored or self._persisted.cluster_id

    def _mint_cluster_id(self) -> str:
        """A new cluster id, for a first formation."""
        if self._new_cluster_id is not None:
            minted = self._new_cluster_id()
        else:
            minted = self._group.replace(":", "-")
        if not _ID_RE.fullmatch(minted):
            raise ElectionError(f"new_cluster_id returned {_show(minted)}, not {_ID_RULE}")
        return minted

    def _cluster_id_ok(self, cluster_id: str, frm: str, what: str) -> bool:
        """Reject a malformed cluster id from a peer (empty means "none yet")."""
        if cluster_id and not _ID_RE.fullmatch(cluster_id):
            self._reject(
                RejectCode.INVALID_MESSAGE,
                f"{what} from {frm} carries cluster id {_show(cluster_id)}, not {_ID_RULE}",
            )
            return False
        return True

    def _same_cluster(self, node: str, cluster_id: str) -> bool:
        """May ``node`` (reporting ``cluster_id``) be merged with us? Logs a foreign node once."""
        mine = self._cluster_id()
        if not cluster_id or not mine or cluster_id == mine:
            if self._foreign.pop(node, None) is not None:
                self._log(
                    LogLevel.WARNING,
                    "cluster-id-changed",
                    f"node {node} now reports cluster {_show(cluster_id or '(none)')}: it "
                    "may be merged again",
                )
            return True
        if self._foreign.get(node) != cluster_id:
            self._foreign[node] = cluster_id
            self._log(
                LogLevel.ERROR,
                "cluster-id-mismatch",
                f"node {node} belongs to cluster {_show(cluster_id)}, this node to cluster "
                f"{_show(mine)}: it is refused (never merged) until its cluster id changes; "
                "is its data directory from another cluster?",
            )
        return False

    def _differs(self, digest: str, version: tuple[int, int] | None = None, base: str = "") -> bool:
        """Do a peer's agreed settings (by digest) differ from ours? "" compares nothing.

        A peer holding another version of the node set (``version``) is compared without
        the node set (``base``): the newer set reaches the other in an invitation."""
        if version is not None and version != self._set_key() and base:
            return bool(self._base_digest) and base != self._base_digest
        return bool(digest) and bool(self._digest) and digest != self._digest

    def _agrees(
        self,
        node: str,
        digest: str,
        settings: tuple[tuple[str, str], ...],
        version: tuple[int, int] | None = None,
        base: str = "",
    ) -> bool:
        """May ``node`` (whose agreed settings have ``digest``) be merged with us?

        A node that differs is refused until its digest matches ours; the refusal is logged
        once per difference when ``settings`` (the peer's values, carried by a probe reply)
        name each setting and both values; until then status shows the two digests."""
        if not self._differs(digest, version, base):
            if self._disagree.pop(node, None) is not None:
                self._log(
                    LogLevel.WARNING,
                    "config-agrees",
                    f"node {node} now shares this node's agreed settings: it may be merged again",
                )
            return True
        known = self._disagree.get(node)
        if settings:
            diffs = differences(self._settings, settings) or differences(
                self._settings, (), their_digest=digest
            )
        elif known is not None and known[0] == digest:
            diffs = known[1]
        else:
            diffs = differences(self._settings, (), their_digest=digest)
        if known != (digest, diffs):
            self._disagree[node] = (digest, diffs)
            if not settings:
                # Only the digest is known: the peer's answer to our next probe names the
                # values, and that is the line worth logging.
                return False
            self._log(
                LogLevel.ERROR,
                "config-mismatch",
                f"node {node} is refused: its configuration differs from this node's ("
                + "; ".join(d.describe(node) for d in diffs)
                + "); it joins no group with this node until both files agree",
            )
        return False

    def _sync_source_of(self, reports: Mapping[str, MemberReport]) -> str:
        """Highest (last_epoch, last_lsn); this node on a tie, then the lower node id."""
        return pick_sync_source(
            {node: (r.last_epoch, r.last_lsn) for node, r in reports.items()}, self._me
        )

    # ----------------------------------------------------------------- transitions

    def _reset_group(self) -> None:
        """Forget the current group's coordinator-side and member-side bookkeeping."""
        self._members = {}
        self._view = ()
        self._group_epoch = 0
        self._sync_source = ""
        self._merge = None
        self._reorg = None
        self._pending = None
        self._merge_at_ms = None
        self._candidates = set()
        self._never_inviting = set()
        self._higher_seen = None
        self._held_reason = ""
        self._held_note = ""
        self._transfer = None
        self._invited = ()
        self._deferred = None
        self._catch_up_candidates = set()
        self._catch_up = set()

    def _recover(self, reason: str, level: LogLevel = LogLevel.INFO) -> None:
        """Back to a group of our own (IceStorm's recovery), replica stopped."""
        self._reset_group()
        self._abandon_proposal(reason, pending_if_persisted=True)
        # A set adopted in memory from an invitation or a change counts only once persisted.
        self._apply_membership(in_force(self._persisted.membership, self._bootstrap))
        self._state = NodeState.INACTIVE
        self._coord = self._me
        self._group = self._make_group_name()
        self._deactivate_if_active()
        self._next_probe_ms = self._now_ms
        self._last_change_reason = reason
        self._log(level, "recovery", f"{reason}; now in own group {self._group}")

    def _fire_timers(self) -> bool:
        """Run whatever is due at ``now``; True if another timer may have become due."""
        now = self._now_ms
        cfg = self._cfg
        silent = self._replica_silent_since
        if (
            silent is not None
            and not self._replica_lost
            and now - silent >= cfg.replica_timeout_ms + self._replica_allowance_ms
        ):
            self._lose_replica(silent)
            return True
        hold_off = self._lead_hold_off
        if hold_off is not None and now >= hold_off.until_ms:
            self._lead_hold_off = None
            self._next_probe_ms = now
            self._last_change_reason = "master-refusal hold-off over"
            self._log(
                LogLevel.INFO,
                "master-refusal-hold-off-over",
                f"hold-off over ({hold_off.why}); this node rejoins and may lead again "
                f"(epoch {self._persisted.epoch})",
            )
            return True
        if self._coord != self._me:
            if self._pending is not None:
                if now >= self._pending.deadline_ms:
                    self._recover(
                        f"replica did not report its stopped state within "
                        f"{cfg.member_timeout_ms} ms of joining {self._pending.group_name}"
                    )
                    return True
                return False
            if now - self._last_yes_ms > cfg.member_timeout_ms:
                failed, group, view = self._coord, self._group, self._view
                deferred = self._deferred
                self._recover(
                    f"coordinator {self._coord} of {self._group} has not answered for "
                    f"{now - self._last_yes_ms} ms"
                )
                self._succeed(failed, group, view, deferred)
                return True
            if now >= self._next_heartbeat_ms:
                self._send(self._coord, AreYouThere(self._group))
                self._next_heartbeat_ms = now + cfg.heartbeat_interval_ms
            return False

        if self._state is NodeState.ELECTION and self._merge is not None:
            merge = self._merge
            if now >= merge.deadline_ms:
                self._maybe_reorganize()
                return True
            if merge.prune_at_ms is not None and now >= merge.prune_at_ms:
                merge.prune_at_ms = None
                merge.pruning = True
                self._prune_silent_invitees(merge)
                return True
            return False
        if self._state is NodeState.REORGANIZATION and self._reorg is not None:
            reorg = self._reorg
            if now >= reorg.deadline_ms:
                self._go_normal()
                return True
            if now >= reorg.next_resend_ms:
                for node in reorg.members:
                    if node != self._me and node not in reorg.acked:
                        self._send(node, self._ready_body(reorg))
                reorg.next_resend_ms = now + cfg.heartbeat_interval_ms
            return False
        transfer = self._transfer
        if transfer is not None and now >= transfer.deadline_ms:
            self._transfer = None
            self._last_change_reason = f"leadership transfer to {transfer.target} timed out"
            self._log(
                LogLevel.WARNING,
                "transfer-timeout",
                f"{transfer.target} did not take over {self._group} within "
                f"{2 * cfg.member_timeout_ms} ms; still master in epoch {self._group_epoch}",
            )
        if self._state is NodeState.NORMAL and self._check_members():
            return True
        if self._state is NodeState.INACTIVE and self._members:
            self._expire_members()
        if self._can_probe() and not self._waiting_for_report():
            if self._can_merge() and self._merge_at_ms is not None and now >= self._merge_at_ms:
                self._do_merge()
                return True
            if self._next_probe_ms is not None and now >= self._next_probe_ms:
                self._probe()
        return False

    def _expire_members(self) -> list[str]:
        """Drop members whose AreYouThere has not arrived for member_timeout_ms."""
        now = self._now_ms
        expired = sorted(
            (x for x, seen in self._members.items() if now - seen > self._cfg.member_timeout_ms),
            key=node_sort_key,
        )
        for node in expired:
            del self._members[node]
            self._log(
                LogLevel.INFO,
                "member-timeout",
                f"member {node} silent for more than {self._cfg.member_timeout_ms} ms; "
                f"dropped from {self._group} (epoch {self._group_epoch})",
            )
        return expired

    def _check_members(self, left: tuple[str, ...] = ()) -> bool:
        """Coordinator in NORMAL: drop silent members (and those that ``left``); recover
        below the quorum."""
        expired = [*left, *self._expire_members()]
        transfer = self._transfer
        if transfer is not None and transfer.target in expired:
            # Its replica is fencing writes for a take-over that cannot come now: lifted at
            # once, not at the fence's deadline (rpc_timeout_ms).
            self._transfer = None
            self._last_change_reason = (
                f"leadership transfer to {transfer.target} given up: it left the group"
            )
            self._o().transfer_dropped = transfer.target
            self._log(
                LogLevel.WARNING,
                "transfer-abandoned",
                f"{transfer.target} left {self._group} before taking it over; still master "
                f"in epoch {self._group_epoch}, writes resume",
            )
        required, why = self._quorum(self._persisted.max_seen)
        size = self._voters_in([*self._members, self._me])
        if size < required:
            self._recover(
                f"lost the quorum of group {self._group} (epoch {self._group_epoch}): "
                f"{size} of {self._n} nodes left, {required} required ({why})",
                LogLevel.WARNING,
            )
            return True
        if expired:
            self._view = tuple(x for x in self._view if x not in expired)
            # Still the epoch's sync source, even if it just left: a replica that has not
            # finished catching up from it must not take its own log as the reference.
            self._command(
                RoleCommandKind.MASTER,
                epoch=self._group_epoch,
                master_id=self._me,
                members=self._view,
                sync_source_id=self._sync_source,
                group_name=self._group,
                cluster_id=self._persisted.cluster_id,
                nodes=self._voting_nodes(),
                learners=self._learner_nodes(),
            )
        return False

    def _voting_nodes(self) -> tuple[str, ...]:
        """The node set a master counts its commit majority from (empty: the file's)."""
        return self._membership.voters if self._membership.version else ()

    def _learner_nodes(self) -> tuple[str, ...]:
        """The learners a master streams to without counting their acks."""
        return self._membership.learners

    def _probe(self) -> None:
        """Ask every other node whether it coordinates a group we could merge."""
        self._next_probe_ms = self._now_ms + self._cfg.probe_interval_ms
        self._higher_seen = None
        for node in self._others:
            self._send_probe(node)
        if (
            self._can_merge()
            and self._state is NodeState.INACTIVE
            and self._merge_at_ms is None
            and self._quorum(self._persisted.max_seen)[0] <= 1
        ):
            # We may run alone; still wait one window so reachable nodes join at once.
            self._merge_soon()

    def _send_probe(self, node: str) -> None:
        """One AreYouCoordinator for ``node``."""
        self._send(
            node,
            AreYouCoordinator(
                self._group,
                self._prio[self._me],
                self._persisted.designated_primary,
                self._cluster_id(),
                serving=self._serving(),
                settings_digest=self._digest,
                # A node known to differ gets our values too, so a node that never
                # probes (a member) can name what differs.
                settings=self._settings if node in self._disagree else (),
                membership_version=self._membership.version,
                membership_epoch=self._membership.epoch,
                base_digest=self._base_digest,
            ),
        )

    def _note_coordinator(
        self, node: str, serving: bool, *, older_set: bool = False, never_invites: bool = False
    ) -> None:
        """``node`` coordinates a group of its own: merge it if it ranks below us. A serving
        node below us, while we serve nothing, is left to invite us to catch up; a node above
        us that serves nothing, while we serve, is invited to catch up (module docstring).

        ``older_set``: ``node`` holds an older node set than ours, under which it may rank
        us above itself and so wait for our invitation while we wait for its (a change of
        priorities that failed left some nodes on the old set): it is invited to catch up
        too, judges the invitation under its set, learns ours from it, and takes the group
        over once caught up if ours ranks it first.

        ``never_invites``: ``node`` holds a newer node set, under which its own priority is
        0, so it never invites; under our older set it may rank above us, and each would
        wait for the other for good (an operator's set-priority 0 that this node missed):
        it is invited as a member, judges the invitation under its set, and we learn that
        set from its answer."""
        self._heard_serving[node] = (serving, self._now_ms)
        if not self._can_merge():
            return
        above = self._rank_of(node) > self._rank_of(self._me)
        if above and not serving and never_invites:
            # A plain member: under its set it ranks below us (a catch-up invitation, for
            # nodes ranked above the inviter, would be refused).
            self._never_inviting.add(node)
            self._merge_soon()
            return
        if above and not serving and (self._serving() or older_set):
            self._catch_up_candidates.add(node)
            self._merge_soon()
            return
        if not above and serving and not self._serving():
            self._log(
                LogLevel.DEBUG,
                "catch-up-wait",
                f"{node} serves a group below this node's rank: waiting for its invitation "
                "to catch up",
            )
            return
        if above:
            higher = self._higher_seen
            if higher is None or self._rank_of(node) > self._rank_of(higher):
                self._higher_seen = node
                if self._merge_at_ms is not None:
                    self._merge_at_ms = self._merge_first_ms + self._merge_delay_ms()
            return
        self._candidates.add(node)
        self._merge_soon()

    def _merge_soon(self) -> None:
        """Opens the merge's collection window, unless one is open."""
        if self._merge_at_ms is None:
            self._merge_first_ms = self._now_ms
            self._merge_at_ms = self._now_ms + self._merge_delay_ms()

    def _do_merge(self) -> None:
        """Invite the lower coordinators found and our members into a fresh group."""
        self._merge_at_ms = None
        invite = {
            x
            for x in self._candidates
            if x in self._prio and self._rank_of(x) < self._rank_of(self._me)
        }
        self._candidates = set()
        invite |= self._never_inviting
        self._never_inviting = set()
        catch_up: set[str] = set()
        if self._serving():
            # Higher-ranked nodes join to catch up; members that joined so and are still
            # catching up keep that standing in the re-formed group.
            catch_up = self._catch_up_candidates | (self._catch_up & set(self._members))
        else:
            # Only those holding an older node set (_note_coordinator) while we serve nothing.
            catch_up = set(self._catch_up_candidates)
        self._catch_up_candidates = set()
        invite |= set(self._members) | catch_up
        alone_ok = self._quorum(self._persisted.max_seen)[0] <= 1
        if not invite and not alone_ok:
            return
        self._start_merge(invite, catch_up=catch_up)

    def _start_merge(
        self,
        invite: set[str],
        transfer_from: str = "",
        catch_up: set[str] | None = None,
        successor_of: str = "",
    ) -> None:
        """Leave the current group and invite ``invite`` into a fresh group of ours.

        ``transfer_from`` names the coordinator handing its group to us: the invitation
        then carries that group's name, so its members accept it from below. ``catch_up``
        names the invitees ranked above us that join to catch up before a hand-over.
        ``successor_of`` names the group whose failed coordinator we succeed
        (``_succeed``): the invitees are probed too, so the merge learns which are alive.
        """
        old_group = self._group
        if self._coord == self._me:
            self._leave_group_for(old_group, invite)
        self._reset_group()
        self._catch_up = set(catch_up or ())
        self._state = NodeState.ELECTION
        self._coord = self._me
        self._group = self._make_group_name()
        self._deactivate_if_active()
        self._merge = _Merge(
            invited=set(invite),
            expected=set(invite),
            accepted={},
            deadline_ms=self._now_ms + self._cfg.member_timeout_ms,
            successor_of=successor_of,
            prune_at_ms=(
                self._now_ms + self._cfg.heartbeat_interval_ms if successor_of and invite else None
            ),
        )
        invitation = Invitation(
            self._group,
            self._prio[self._me],
            self._persisted.epoch,
            cluster_id=self._cluster_id(),
            transfer_group=old_group if transfer_from else "",
            catch_up=tuple(sorted(self._catch_up, key=node_sort_key)),
            settings_digest=self._digest,
            base_digest=self._base_digest,
            membership=self._wire_membership(),
        )
        ordered = sorted(invite, key=node_sort_key)
        self._invited = tuple(ordered)
        for node in ordered:
            self._send(node, invitation)
        invited = ",".join(ordered) or "nobody"
        if successor_of:
            # Any answer proves an invitee alive; one still waiting out its own timeout
            # answers a probe at once, so silence marks a node that is gone.
            for node in ordered:
                self._send_probe(node)
            failed = successor_of.partition(":")[0]
            self._last_change_reason = (
                f"succeeding coordinator {failed} of {successor_of}: inviting {invited}"
            )
            self._log(
                LogLevel.INFO,
                "successor",
                f"coordinator {failed} of {successor_of} is gone and this node ranks highest "
                f"of its members left: inviting {invited} to {self._group} at once",
            )
        elif transfer_from:
            self._last_change_reason = (
                f"taking over {old_group} from {transfer_from} by leadership transfer"
            )
            self._log(
                LogLevel.WARNING,
                "transfer-take-over",
                f"{transfer_from} hands {old_group} over; inviting {invited} to {self._group}",
            )
        else:
            self._last_change_reason = f"merging {invited} into a new group"
            catching = ",".join(sorted(self._catch_up, key=node_sort_key))
            self._log(
                LogLevel.INFO,
                "merge",
                f"leaving {old_group}; inviting {invited} to {self._group}"
                + (
                    f" ({catching} ranked above this node: to catch up, then take the group over)"
                    if catching
                    else ""
                ),
            )
        self._maybe_reorganize()

    def _succeed(
        self,
        failed: str,
        group: str,
        view: tuple[str, ...],
        deferred: _DeferredInvitation | None,
        *,
        invite: bool = True,
    ) -> None:
        """Just recovered because coordinator ``failed`` of our NORMAL ``group`` (members
        ``view``) is gone: its highest-ranked eligible survivor invites the other survivors
        at once; any other survivor takes a successor's invitation it received while
        ``failed`` still answered it (module docstring, "Succession"). Without ``invite``
        (the coordinator answers, but no longer leads the group) only the latter."""
        if self._out_of_groups():
            return
        # A node a membership change removed since the view formed is no survivor.
        survivors = [x for x in view if x != failed and x in self._prio]
        if (
            invite
            and self._eligible
            and survivors
            and max(survivors, key=self._rank_of) == self._me
        ):
            others = set(survivors) - {self._me}
            if others or self._quorum(self._persisted.max_seen)[0] <= 1:
                self._start_merge(others, successor_of=group)
            return
        if deferred is not None and self._now_ms <= deferred.until_ms:
            self._log(
                LogLevel.INFO,
                "invitation-resumed",
                f"taking {deferred.frm}'s invitation to {deferred.body.group_name} kept "
                f"while coordinator {failed} still answered",
            )
            self._on_invitation(deferred.frm, deferred.body)

    def _prune_silent_invitees(self, merge: _Merge) -> None:
        """A successor's merge stops waiting for invitees it never heard from, once the
        accepts make the quorum; they were dead in the old view (``_Merge``)."""
        # Only those invited (and probed) when the merge began: a member an accepting
        # coordinator forwarded the invitation to later has had no time to answer.
        silent = (merge.expected & merge.invited) - merge.heard - merge.accepted.keys()
        if not silent:
            return
        group_max = max([self._persisted.max_seen, *(r.max_seen for r in merge.accepted.values())])
        if self._voters_in([*merge.accepted, self._me]) < self._quorum(group_max)[0]:
            return
        merge.expected -= silent
        waited_ms = self._now_ms - (merge.deadline_ms - self._cfg.member_timeout_ms)
        self._log(
            LogLevel.INFO,
            "invitees-silent",
            f"{','.join(sorted(silent, key=node_sort_key))} answered nothing within "
            f"{waited_ms} ms of the invitation to {self._group}: not waiting for them",
        )
        self._maybe_reorganize()

    def _maybe_reorganize(self) -> None:
        """ELECTION ends when every invitee accepted or the deadline passed."""
        merge = self._merge
        if self._state is not NodeState.ELECTION or merge is None:
            return
        complete = merge.expected <= merge.accepted.keys()
        if not complete and self._now_ms < merge.deadline_ms:
            return
        if not self._report_fresh:
            if self._now_ms < merge.deadline_ms:
                return
            self._recover(
                f"replica did not report its stopped state within "
                f"{self._cfg.member_timeout_ms} ms; cannot name a sync source",
                LogLevel.WARNING,
            )
            return
        self._reorganize()

    def _reorganize(self) -> None:
        """Check the quorum, pick epoch and sync source, persist, send Ready."""
        merge = self._merge
        if merge is None:
            raise ElectionError("reorganize without a merge")
        self._merge = None
        mine = self._my_report()
        reports: dict[str, MemberReport] = {self._me: mine, **merge.accepted}
        reference = mine.cluster_id
        if not reference:
            holders = {x: r for x, r in reports.items() if r.cluster_id}
            if holders:
                reference = reports[self._sync_source_of(holders)].cluster_id
        for node in sorted(reports, key=node_sort_key):
            cid = reports[node].cluster_id
            if reference and cid and cid != reference:
                del reports[node]
                self._foreign[node] = cid
                self._log(
                    LogLevel.ERROR,
                    "cluster-id-mismatch",
                    f"member {node} belongs to cluster {_show(cid)}, the group to cluster "
                    f"{_show(reference)}; leaving it out of {self._group} and refusing it "
                    "until its cluster id changes",
                )
        self._adopt_newest(reports)
        for node in sorted(reports, key=node_sort_key):
            if node not in self._prio:
                # Not in the group's node set (removed): it takes no part.
                del reports[node]
        size = self._voters_in(reports)
        group_max = max(r.max_seen for r in reports.values())
        required, why = self._quorum(group_max)
        old_short = self._old_set_short(reports.keys())
        if size < required or old_short:
            self._hold(
                merge.accepted.keys() & reports.keys(),
                f"not enough nodes for replication to commence: {size} of {self._n} in "
                f"{self._group}, {required} required ({why})" + old_short,
            )
            return
        # A learner's store holds nothing the cluster needs: the voters' stores decide.
        decision = decide_start(
            {x: r for x, r in reports.items() if x not in self._learners}, self._n
        )
        if not decision.ok:
            self._hold(
                merge.accepted.keys() & reports.keys(),
                decision.reason,
                LogLevel.ERROR,
                "until a node restarts or its store changes",
            )
            return
        cluster_id = reference or self._mint_cluster_id()
        if cluster_id != reference:
            self._log(
                LogLevel.INFO,
                "cluster-id-minted",
                f"first formation: every store is empty; the cluster is {cluster_id}",
            )
        elif decision.cold:
            self._log(LogLevel.INFO, "cold-start", decision.reason)
        epoch = max(r.epoch for r in reports.values()) + 1
        members = tuple(sorted(reports, key=node_sort_key))
        wire: Membership | None = None
        if self._membership.version:
            # The set is persisted with the epoch (this node's vote), by every member on Ready.
            wire = replace(self._membership, epoch=epoch)
            self._apply_membership(wire)
            self._persist(epoch=epoch, cluster_id=cluster_id, membership=wire)
        else:
            self._persist(epoch=epoch, cluster_id=cluster_id)
        self._state = NodeState.REORGANIZATION
        reorg = _Reorg(
            epoch=epoch,
            members=members,
            reports=reports,
            acked=set(),
            deadline_ms=self._now_ms + self._cfg.member_timeout_ms,
            next_resend_ms=self._now_ms + self._cfg.heartbeat_interval_ms,
            cluster_id=cluster_id,
            membership=wire,
        )
        self._reorg = reorg
        sync = self._sync_source_of(reports)
        self._last_change_reason = f"reorganizing {self._group} in epoch {epoch}"
        self._log(
            LogLevel.INFO,
            "reorganize",
            f"coordinator of {self._group}: epoch {epoch}, members {','.join(members)}, "
            f"sync source {sync} (log {reports[sync].last_epoch}/{reports[sync].last_lsn})",
        )
        for node in members:
            if node != self._me:
                self._send(node, self._ready_body(reorg))
        if size == 1:
            self._go_normal()

    def _adopt_newest(self, reports: Mapping[str, MemberReport]) -> None:
        """A member that persisted a newer node set than this node brings it in (the set of
        the newest group wins, as Raft's newest log term): a change in progress here is
        dropped, since it was made from an older set."""
        candidates = {x: r.membership for x, r in reports.items() if r.membership is not None}
        best = newest(candidates)
        if not best:
            return
        found = candidates[best]
        if not self._is_newer(found) or self._me not in found.ids:
            return
        mine = self._membership
        if self._proposal is not None:
            self._abandon_proposal(f"member {best} holds the newer node set {found.describe()}")
        self._apply_membership(found)
        self._log(
            LogLevel.INFO,
            "membership-adopted",
            f"member {best} persisted node set {found.describe()}, newer than this node's "
            f"{mine.describe()}; {self._group} forms under it",
        )

    def _old_set_short(self, nodes: Collection[str]) -> str:
        """While a change is in progress the group also needs a majority of the set it
        changes from; why it falls short, or ""."""
        if self._proposal is None:
            return ""
        old = in_force(self._persisted.membership, self._bootstrap)
        have = len(set(nodes) & set(old.voters))
        if have >= old.majority:
            return ""
        return (
            f"; the membership change {self._proposal.describe()} also needs "
            f"{old.majority} of the old set's voters {','.join(old.voters)}, and {have} are "
            "here"
        )

    def _hold(
        self,
        members: set[str],
        reason: str,
        level: LogLevel = LogLevel.INFO,
        until: str = "and waiting for more nodes",
    ) -> None:
        """Too few nodes, or stores that refuse a cold start: keep the group together,
        INACTIVE, and look for more.

        IceStorm recovers here, scattering the members; they would then rejoin at different
        times and a full startup that needs every node could keep missing one. Holding
        them lets the next merge take the waiting members and the newcomer at once. The
        members hear ``reason`` in the answers to their heartbeats.
        """
        self._abandon_proposal(reason, pending_if_persisted=True)
        # A set only in memory (a change, or adopted from a report) counts once a group
        # persists it; the next merge adopts the newest reported set again.
        self._apply_membership(in_force(self._persisted.membership, self._bootstrap))
        self._state = NodeState.INACTIVE
        self._members = {x: self._now_ms for x in members if x in self._prio}
        self._next_probe_ms = self._now_ms
        self._last_change_reason = reason
        self._held_reason = reason
        self._log(
            level,
            "waiting",
            f"{reason}; holding {','.join(sorted(members, key=node_sort_key)) or 'no members'} "
            f"{until}",
        )

    def _ready_body(self, reorg: _Reorg) -> GroupReady:
        """The Ready message for this reorganization."""
        group_max = max(r.max_seen for r in reorg.reports.values())
        return GroupReady(
            group_name=self._group,
            epoch=reorg.epoch,
            members=reorg.members,
            sync_source_id=self._sync_source_of(reorg.reports),
            coordinator_id=self._me,
            max_seen=max(group_max, self._voters_in(reorg.members)),
            cluster_id=reorg.cluster_id,
            membership=reorg.membership,
        )

    def _go_normal(self) -> None:
        """Go NORMAL with the members that persisted the epoch, if they make the quorum."""
        reorg = self._reorg
        if reorg is None:
            raise ElectionError("go normal without a reorganization")
        final = tuple(x for x in reorg.members if x == self._me or x in reorg.acked)
        reports = {x: reorg.reports[x] for x in final}
        group_max = max(r.max_seen for r in reports.values())
        required, why = self._quorum(group_max)
        old_short = self._old_set_short(final)
        if self._voters_in(final) < required or old_short:
            missing = ",".join(x for x in reorg.members if x not in final)
            self._recover(
                f"only {len(final)} of {len(reorg.members)} members persisted epoch "
                f"{reorg.epoch} (missing {missing}), {required} required ({why})" + old_short
            )
            return
        sync = self._sync_source_of(reports)
        self._reorg = None
        self._persist(max_seen=max(self._persisted.max_seen, group_max, self._voters_in(final)))
        self._state = NodeState.NORMAL
        self._group_epoch = reorg.epoch
        self._view = final
        self._sync_source = sync
        # Only a member the group's set ranks above this node is handed the group once
        # caught up: a catch-up invitation sent under an older set may have named one that
        # the newer set adopted from the reports ranks below.
        self._catch_up = {
            x for x in self._catch_up & set(final) if self._rank_of(x) > self._rank_of(self._me)
        }
        self._members = {x: self._now_ms for x in final if x != self._me}
        self._next_probe_ms = self._now_ms + self._cfg.probe_interval_ms
        self._command(
            RoleCommandKind.MASTER,
            epoch=reorg.epoch,
            master_id=self._me,
            members=final,
            sync_source_id=sync,
            group_name=self._group,
            cluster_id=reorg.cluster_id,
            nodes=self._voting_nodes(),
            learners=self._learner_nodes(),
        )
        self._last_change_reason = (
            f"coordinator of {self._group} in epoch {reorg.epoch} with {','.join(final)}"
        )
        change = self._proposal
        if change is not None:
            self._proposal = None
            # A member the new set ranks above this node takes the lead once caught up
            # (the rejoin hand-over): priority decides who leads.
            self._catch_up |= {x for x in final if self._rank_of(x) > self._rank_of(self._me)}
            self._membership_note = (
                f"{change.describe()}: done in epoch {reorg.epoch} "
                f"(node set {self._membership.describe()})"
            )
            self._log(
                LogLevel.WARNING,
                "membership-changed",
                f"membership change {change.describe()} done: group {self._group} formed in "
                f"epoch {reorg.epoch} under node set {self._membership.describe()}, persisted "
                f"by {','.join(final)}",
            )
        self._log(
            LogLevel.INFO,
            "normal",
            f"reporting for duty as coordinator of {self._group}: epoch {reorg.epoch}, "
            f"members {','.join(final)} ({self._voters_in(final)}/{self._n}"
            + (
                f"; learners {','.join(x for x in final if x in self._learners)}"
                if self._learners & set(final)
                else ""
            )
            + f"), sync source {sync}",
        )
        self._revert_override_if_majority(final, reorg.epoch)

    # ----------------------------------------------------------------- replica

    def _on_report(self, report: ReplicaReport) -> None:
        """A report taken while the replica is stopped unblocks accepts and reorganizing."""
        if report.last_epoch < 0 or report.last_lsn < 0:
            self._reject(
                RejectCode.INVALID_ARGUMENT,
                f"replica report with negative position {report.last_epoch}/{report.last_lsn}",
            )
            return
        # Only a report read after our latest command (a DEACTIVATE) took effect describes
        # a log that can no longer grow; an older one, even one taken while the replica
        # was stopped, may miss entries it received before that stop.
        stopped_now = (
            not report.active
            and self._role is Role.INACTIVE
            and report.command_seq == self._command_seq
        )
        if not stopped_now:
            # A late, older report must not replace the stopped state we already hold
            # (the simulator found that: it named a stale sync source).
            if not self._report_fresh:
                self._report = report
            return
        self._report = report
        self._report_fresh = True
        self._try_send_accept()
        self._maybe_reorganize()

    def _try_send_accept(self) -> None:
        """Answer a pending invitation once the replica's stopped state is known."""
        pending = self._pending
        if pending is None or not self._report_fresh:
            return
        self._pending = None
        self._send(self._coord, Accept(pending.group_name, self._my_report(), pending.forwarded_to))
        self._last_yes_ms = self._now_ms
        self._next_heartbeat_ms = self._now_ms + self._cfg.heartbeat_interval_ms

    # ----------------------------------------------------------------- one fate per node

    def _on_replica_silent(self, since_ms: int, store_stalled: bool, answer_ms: int) -> None:
        """Note since when the replica has not answered; the timers decide."""
        if since_ms > self._now_ms:
            self._reject(
                RejectCode.INVALID_ARGUMENT,
                f"replica silent since {since_ms}, which is after now ({self._now_ms})",
            )
            return
        if answer_ms < 0:
            self._reject(RejectCode.INVALID_ARGUMENT, f"replica answers took {answer_ms} ms (< 0)")
            return
        if self._replica_silent_since is None:
            self._replica_silent_since = since_ms
            # A stuck disk has its own timeout (the driver's): no allowance for it.
            self._replica_allowance_ms = 0 if store_stalled else self._allowance_ms(answer_ms)
        self._replica_store_stalled = store_stalled

    def _allowance_said(self) -> str:
        allowance = self._replica_allowance_ms
        return f" + {allowance} allowed for its slow answers" if allowance else ""

    def _allowance_ms(self, answer_ms: int) -> int:
        """The silence allowed on top of replica_timeout_ms to a replica whose recent
        answers took up to answer_ms: a few of them; never more than one timeout more."""
        return min(self._cfg.replica_timeout_ms, ANSWER_ALLOWANCE_FACTOR * answer_ms)

    def _on_replica_answered(self) -> None:
        """The replica answers: forget the silence; a node out for it rejoins."""
        since = self._replica_silent_since
        stalled = self._replica_store_stalled
        self._replica_silent_since = None
        self._replica_store_stalled = False
        if not self._replica_lost:
            return
        self._replica_lost = False
        silent_ms = self._now_ms - (since if since is not None else self._now_ms)
        back = (
            f"replica store writes complete again after {silent_ms} ms stalled"
            if stalled
            else f"replica answers again after {silent_ms} ms unreachable"
        )
        self._log(
            LogLevel.INFO,
            "replica-back",
            f"{back} (epoch {self._persisted.epoch}); reading its state and rejoining",
        )
        self._recover(back)
        # Whatever the replica reported before it went silent may be stale (it may have
        # restarted): read its stopped state afresh before answering any invitation.
        self._command(RoleCommandKind.DEACTIVATE)

    def _lose_replica(self, since_ms: int) -> None:
        """The replica has not answered for replica_timeout_ms: leave the group, telling it,
        and stay out of every group until the replica answers again."""
        silent_ms = self._now_ms - since_ms
        group, epoch, role = self._group, self._group_epoch, self._role
        stalled = self._replica_store_stalled
        reason = (
            f"replica store of node {self._me} stalled: no write completed for {silent_ms} ms"
            if stalled
            else f"replica of node {self._me} has not answered for {silent_ms} ms "
            f"(replica_timeout_ms {self._cfg.replica_timeout_ms}{self._allowance_said()})"
        )
        told = self._tell_leaving(reason)
        self._replica_lost = True
        in_group = f"{group} (epoch {epoch}, role {role.value})" if epoch else group
        what = (
            f"replica store stalled: no write completed for {silent_ms} ms"
            if stalled
            else f"replica has not answered for {silent_ms} ms (replica_timeout_ms "
            f"{self._cfg.replica_timeout_ms}{self._allowance_said()}"
        )
        until = "its writes complete" if stalled else "it answers"
        self._log(
            LogLevel.WARNING,
            "replica-store-stalled" if stalled else "replica-unreachable",
            f"{what}{' (' if stalled else ', '}epoch {self._persisted.epoch}); leaving "
            f"{in_group} and every group until {until}"
            + (f"; told {','.join(sorted(told, key=node_sort_key))}" if told else ""),
        )
        self._recover(
            f"replica store stalled: no write completed for {silent_ms} ms; out of every "
            "group until its writes complete"
            if stalled
            else f"replica unreachable: no answer for {silent_ms} ms; out of every group "
            "until it answers"
        )

    def _tell_leaving(self, reason: str) -> list[str]:
        """Send ``Leave`` to whoever would otherwise notice this node's going only by its
        silence: its members and invitees as coordinator, else its coordinator."""
        if self._coord == self._me:
            told: set[str] = set(self._members)
            if self._merge is not None:
                told |= self._merge.expected | self._merge.accepted.keys()
            if self._reorg is not None:
                told |= set(self._reorg.members)
        else:
            told = {self._coord}
        told.discard(self._me)
        ordered = sorted(told, key=node_sort_key)
        for node in ordered:
            self._send(node, Leave(self._group, reason))
        return ordered

    def _on_stopping(self, reason: str) -> None:
        told = self._tell_leaving(reason)
        self._log(
            LogLevel.INFO,
            "stopping",
            f"leaving {self._group} (epoch {self._group_epoch}): {reason}"
            + (f"; told {','.join(told)}" if told else ""),
        )

    def _on_leave(self, frm: str, body: Leave) -> None:
        """A node leaves our group: a member is dropped at once, a coordinator recovered from."""
        coordinator = self._group_coordinator(body.group_name, frm)
        if coordinator is None:
            return
        why = f": {_show(body.reason)}" if body.reason else ""
        if body.group_name != self._group:
            self._log(
                LogLevel.DEBUG,
                "leave-ignored",
                f"{frm} left {body.group_name}, which is not our group {self._group}",
            )
            return
        if self._coord != self._me:
            if frm == self._coord:
                group, view, deferred = self._group, self._view, self._deferred
                self._recover(f"coordinator {frm} left {self._group}{why}", LogLevel.WARNING)
                self._succeed(frm, group, view, deferred)
            return
        if coordinator != self._me:
            return
        merge = self._merge
        if merge is not None:
            invitee = frm in merge.expected and frm not in merge.accepted
            self._log(
                LogLevel.INFO,
                "invitee-declined" if invitee else "member-left",
                f"invitee {frm} will not join {self._group}{why}: not waiting for it"
                if invitee
                else f"member {frm} left {self._group} (epoch {self._group_epoch}){why}",
            )
            merge.expected.discard(frm)
            merge.accepted.pop(frm, None)
            self._maybe_reorganize()
            return
        self._log(
            LogLevel.INFO,
            "member-left",
            f"member {frm} left {self._group} (epoch {self._group_epoch}){why}",
        )
        reorg = self._reorg
        if reorg is not None:
            if frm in reorg.members:
                reorg.members = tuple(x for x in reorg.members if x != frm)
                reorg.reports.pop(frm, None)
                reorg.acked.discard(frm)
                if len(reorg.acked) == len(reorg.members) - 1:
                    self._go_normal()
            return
        if frm not in self._members:
            return
        del self._members[frm]
        if self._state is NodeState.NORMAL:
            self._check_members(left=(frm,))

    def _on_cut_off_member(self, node: str, silent_ms: int, bound_ms: int) -> None:
        if (
            self._coord != self._me
            or self._state is not NodeState.NORMAL
            or node not in self._members
        ):
            return
        self._send(node, StepAside(self._group, self._group_epoch, silent_ms, bound_ms))
        self._log(
            LogLevel.WARNING,
            "member-cut-off",
            f"dropping member {node} from {self._group} (epoch {self._group_epoch}) and "
            f"telling it to step aside: {_cut_off_why('its', silent_ms, bound_ms)}",
        )
        del self._members[node]
        self._check_members(left=(node,))

    def _on_step_aside(self, frm: str, body: StepAside) -> None:
        """Our coordinator dropped us: the driver holds us out of every group a while."""
        if (
            body.group_name != self._group
            or frm != self._coord
            or frm == self._me
            or body.epoch != self._group_epoch
        ):
            self._log(
                LogLevel.DEBUG,
                "step-aside-ignored",
                f"{frm} asked this node to step aside from {body.group_name} (epoch "
                f"{body.epoch}), which is not its group {self._group} (epoch "
                f"{self._group_epoch}) with {frm} coordinating",
            )
            return
        why = _cut_off_why("this node's", body.silent_ms, body.bound_ms)
        self._o().step_aside = (
            f"coordinator {frm} dropped it from {body.group_name} (epoch {body.epoch}): {why}"
        )

    # ----------------------------------------------------------------- rejoin

    def _on_slave_lags(self, lags: Mapping[str, int]) -> None:
        """Promote a learner whose replica has caught up; hand the group to the
        highest-ranked member that joined to catch up, once its replica is close enough to
        the master's log."""
        if any(lag < 0 for lag in lags.values()):
            self._reject(
                RejectCode.INVALID_ARGUMENT,
                f"slave lags must not be negative: {dict(sorted(lags.items()))}",
            )
            return
        if self._promote_caught_up(lags):
            return
        waiting = [x for x in self._view if x in self._catch_up]
        if (
            not waiting
            or not self._serving()
            or self._transfer is not None
            or self._hand_over_pending()
        ):
            return
        target = max(waiting, key=lambda x: self._rank_of(x))
        lag = lags.get(target)
        if lag is None or lag > CATCH_UP_LAG_ENTRIES_MAX:
            return
        if self.transfer_refusal(target) is not None:
            return
        self._hand_over_next_ms = self._now_ms + 2 * self._cfg.member_timeout_ms
        self._hand_over_epoch = self._group_epoch
        self._o().hand_over_to = target
        self._log(
            LogLevel.INFO,
            "caught-up",
            f"{target}, ranked above this node, joined {self._group} to catch up and lags "
            f"{lag} entries (at most {CATCH_UP_LAG_ENTRIES_MAX}): handing the group over to "
            f"it (epoch {self._group_epoch})",
        )

    def _hand_over_pending(self) -> bool:
        """May a hand-over asked for earlier still be under way (so not asked again yet)?

        One asked in this group (epoch) may be: the replica is fencing its writes, or the
        transfer has not re-formed the group; it is asked again after ``2 *
        member_timeout_ms``, the transfer's own limit. One asked in an earlier group is
        over: the transfer, called once the replica is ready, is refused when the group
        has changed meanwhile (``transfer_refusal``: this node was not NORMAL, a merge had
        begun), and one that started hands the group over or times out in the group it
        started in. Waiting out that limit in the re-formed group would keep a caught-up
        member from the lead for nothing (election seed 50084: a catch-up merge began
        between the ask and the transfer, and the re-formed group waited 700 ms to ask
        again)."""
        return self._hand_over_epoch == self._group_epoch and self._now_ms < self._hand_over_next_ms

    def _promote_caught_up(self, lags: Mapping[str, int]) -> bool:
        """A learner of the serving group whose replica lags at most
        ``CATCH_UP_LAG_ENTRIES_MAX`` entries becomes a voter: the coordinator makes the
        change itself (one voter more, a single-server change like the operator's). Was a
        promotion started?"""
        ready = [
            x
            for x in self._view
            if x in self._learners
            and lags.get(x, CATCH_UP_LAG_ENTRIES_MAX + 1) <= CATCH_UP_LAG_ENTRIES_MAX
        ]
        if (
            not ready
            or not self._serving()
            or self._proposal is not None
            or self._transfer is not None
            or self._now_ms < self._promote_next_ms
        ):
            return False
        target = ready[0]
        # One try per window: a promotion that fails (the group did not re-form) is asked
        # for again after the merge's own limit.
        self._promote_next_ms = self._now_ms + 2 * self._cfg.member_timeout_ms
        self._log(
            LogLevel.INFO,
            "learner-caught-up",
            f"learner {target} lags {lags[target]} entries (at most "
            f"{CATCH_UP_LAG_ENTRIES_MAX}) behind the master of epoch {self._group_epoch}: "
            "promoting it to voter",
        )
        refusal = self._propose(
            MembershipChange(ChangeKind.PROMOTE, target),
            "coordinator",
            f"learner caught up ({lags[target]} entries behind)",
        )
        if refusal:
            self._log(LogLevel.INFO, "learner-not-promoted", f"learner {target}: {refusal}")
            return False
        return True

    # ----------------------------------------------------------------- operator

    def _on_membership_change(self, change: MembershipChange, operator: str, reason: str) -> None:
        """Check an operator's membership change and re-form the group under the new set."""
        if change.kind not in OPERATOR_CHANGES:
            self._reject(
                RejectCode.INVALID_ARGUMENT,
                f"membership change {change.describe()} refused: the coordinator promotes a "
                "learner itself once it has caught up",
            )
            return
        refusal = self._propose(change, operator, reason)
        if refusal:
            self._reject(RejectCode.FAILED_PRECONDITION, refusal)

    def _propose(self, change: MembershipChange, operator: str, reason: str) -> str:
        """Check a membership change and re-form the group under the new set; the refusal,
        or "" once the change is in progress."""
        who = operator or "unknown operator"
        refused = f"membership change {change.describe()} refused ({who})"
        if self._proposal is not None:
            return (
                f"{refused}: the change {self._proposal.describe()} is in progress; one change "
                "at a time (see squall status)"
            )
        if not self._serving():
            return (
                f"{refused}: only the coordinator of the serving group changes the node set; "
                f"this node is {self._state.value} (coordinator {self._coord})"
            )
        if self._transfer is not None:
            return f"{refused}: a leadership transfer to {self._transfer.target} is in progress"
        if self._persisted.quorum_override or self._persisted.designated_primary:
            control = (
                "quorum override" if self._persisted.quorum_override else ("designated primary")
            )
            return (
                f"{refused}: the {control} is in force; clear it first, a change counts majorities"
            )
        try:
            new = apply_change(self._membership, change, live=self._view, coordinator=self._me)
        except ChangeRefused as exc:
            return f"{refused}: {exc}"
        old = self._membership
        self._record(who, f"membership {change.describe()}", reason)
        self._proposal = change
        self._proposed = new
        self._membership_note = f"{change.describe()}: in progress (v{new.version})"
        self._log(
            LogLevel.WARNING,
            "membership-change",
            f"MEMBERSHIP CHANGE by {who}: {change.describe()}; node set {old.describe()} -> "
            f"v{new.version} {new.describe().split(': ', 1)[1]}; "
            f"re-forming {self._group} under it" + (f" ({reason})" if reason else ""),
        )
        self._apply_membership(new)
        invite = {x for x in self._view if x != self._me and x in self._prio}
        if change.kind in (ChangeKind.ADD, ChangeKind.REPLACE):
            invite.add(change.node_id)
        self._start_merge(invite)
        return ""

    def _on_designated_primary(self, enabled: bool, operator: str) -> None:
        """Set or clear the designated primary flag (two-node clusters only)."""
        who = operator or "unknown operator"
        if enabled:
            if self._n != 2:
                self._reject(
                    RejectCode.FAILED_PRECONDITION,
                    f"designated primary refused ({who}): the cluster has {self._n} nodes, "
                    "not two; use the quorum override instead",
                )
                return
            if not self._eligible:
                self._reject(
                    RejectCode.FAILED_PRECONDITION,
                    f"designated primary refused ({who}): this node has priority 0 and "
                    "never coordinates",
                )
                return
            holders = sorted(x for x, flag in self._peer_designated.items() if flag)
            if holders:
                self._reject(
                    RejectCode.FAILED_PRECONDITION,
                    f"designated primary refused ({who}): node {holders[0]} already holds "
                    "it; two designated primaries could both run alone (split brain)",
                )
                return
        if enabled == self._persisted.designated_primary:
            return
        self._persist(designated_primary=enabled)
        self._next_probe_ms = self._now_ms
        if enabled:
            self._log(
                LogLevel.WARNING,
                "operator-designated-primary",
                f"DESIGNATED PRIMARY SET by {who}: this node will run alone when the other "
                "node is unreachable; never set it on both nodes",
            )
        else:
            self._log(
                LogLevel.WARNING,
                "operator-designated-primary",
                f"designated primary cleared by {who}",
            )

    def _on_quorum_override(self, required: int, operator: str, reason: str) -> None:
        """Set (1..n) or clear (0) the quorum override, with an audit record."""
        who = operator or "unknown operator"
        if not 0 <= required <= self._n:
            self._reject(
                RejectCode.INVALID_ARGUMENT,
                f"quorum override {required} refused ({who}): use 1 to {self._n}, or 0 to clear",
            )
            return
        if required == self._persisted.quorum_override:
            return
        why = f" ({reason})" if reason else ""
        if required:
            record = self._record(who, f"quorum-override {required}", reason)
            self._persist(quorum_override=required, quorum_override_record=record)
            self._log(
                LogLevel.WARNING,
                "operator-quorum-override",
                f"QUORUM OVERRIDE SET by {who}{why}: groups need only {required} of {self._n} "
                f"nodes (majority is {self._majority}); two groups may now both serve",
            )
        else:
            self._record(who, "quorum-override cleared", reason)
            self._persist(quorum_override=0, quorum_override_record=None)
            self._log(
                LogLevel.WARNING,
                "operator-quorum-override",
                f"quorum override cleared by {who}{why}",
            )
        self._next_probe_ms = self._now_ms

    def _revert_override_if_majority(self, members: tuple[str, ...], epoch: int) -> None:
        """The override is for disaster recovery: once this node is in a normal group with a
        majority of the configured nodes, it is no longer needed and would only risk a split
        brain at the next partition, so it clears itself."""
        override = self._persisted.quorum_override
        if not override or self._voters_in(members) < self._majority:
            return
        record = self._persisted.quorum_override_record
        set_by = f" (set by {record.operator} at {record.at_ms})" if record is not None else ""
        reason = (
            f"{len(members)} of {self._n} nodes ({','.join(members)}) are in group "
            f"{self._group} in epoch {epoch}, a majority"
        )
        self._record("auto", "quorum-override cleared", reason)
        self._persist(quorum_override=0, quorum_override_record=None)
        self._log(
            LogLevel.WARNING,
            "operator-quorum-override",
            f"quorum override {override}{set_by} cleared automatically: {reason}",
        )

    def _on_transfer_request(self, target: str, operator: str, reason: str) -> None:
        """Start handing the group to ``target``: tell it to invite our members."""
        who = operator or "unknown operator"
        refusal = self.transfer_refusal(target)
        if refusal is not None:
            self._reject(refusal.code, refusal.message.removeprefix(f"node {self._me}: "))
            return
        self._record(who, f"transfer to {target}", reason)
        self._transfer = _Transfer(target, self._now_ms + 2 * self._cfg.member_timeout_ms)
        self._send(target, LeadershipTransfer(self._group, self._group_epoch, target, self._view))
        self._last_change_reason = f"handing {self._group} to {target} (transfer by {who})"
        why = f" ({reason})" if reason else ""
        self._log(
            LogLevel.WARNING,
            "operator-transfer",
            f"LEADERSHIP TRANSFER to {target} by {who}{why}: {target} holds the whole log; "
            f"it will invite {','.join(x for x in self._view if x != target)} into a group "
            f"of its own (epoch above {self._group_epoch})",
        )

    def _on_replica_fault(self, fault_id: str, reason: str) -> None:
        """Quarantine on a fault the replica reported, once per fault."""
        p = self._persisted
        if not fault_id or fault_id in (p.quarantine_fault_id, p.cleared_fault_id):
            return
        if p.quarantine is not None:
            # Already quarantined (by an operator, or an earlier fault): note the new fault.
            self._persist(quarantine_fault_id=fault_id)
            return
        self._quarantine("replica", f"replica fault: {reason}", fault_id)

    def _on_set_quarantine(self, enabled: bool, operator: str, reason: str) -> None:
        """Quarantine (operator) or clear the quarantine."""
        who = operator or "unknown operator"
        p = self._persisted
        if enabled:
            if p.quarantine is None:
                self._quarantine(who, reason or "operator", "")
            return
        if p.quarantine is None:
            return
        self._record(who, "unquarantine", reason)
        self._persist(
            quarantine=None,
            quarantine_fault_id="",
            cleared_fault_id=p.quarantine_fault_id or p.cleared_fault_id,
        )
        self._next_probe_ms = self._now_ms
        self._last_change_reason = f"quarantine cleared by {who}"
        self._log(
            LogLevel.WARNING,
            "quarantine",
            f"quarantine cleared by {who} (was: {p.quarantine.reason}); this node rejoins",
        )

    def _quarantine(self, operator: str, reason: str, fault_id: str) -> None:
        """Leave any group and stay out of all of them, persisted."""
        record = self._record(operator, "quarantine", reason)
        self._persist(quarantine=record, quarantine_fault_id=fault_id)
        level = LogLevel.ERROR if fault_id else LogLevel.WARNING
        # Told, not left to their heartbeats: a node quarantined on a fault is often
        # stopped moments later (a repair, a restart), and then its members would wait out
        # member_timeout_ms with no master (chaos seed 88: 1.0-1.1 s).
        told = self._tell_leaving(f"node {self._me} is quarantined: {reason}")
        self._log(
            level,
            "quarantine",
            f"QUARANTINED by {operator}: {reason}; never master, never counted for acks "
            "or the quorum until an operator clears it"
            + (f"; told {','.join(told)}" if told else ""),
        )
        self._recover(f"quarantined: {reason}", level)

    def _on_replica_losses(self, losses: tuple[LossRecord, ...]) -> None:
        """Keep each loss report not yet held or acknowledged."""
        p = self._persisted
        known = {r.loss_id for r in p.losses} | set(p.acked_loss_ids)
        new = tuple(r for r in losses if r.loss_id not in known)
        if not new:
            return
        self._persist(losses=(*p.losses, *new)[-LOSS_RECORDS_MAX:])
        for record in new:
            self._log(
                LogLevel.ERROR,
                "loss",
                f"{LOSS_MESSAGE_ID} acknowledged events discarded: {record.summary()} "
                f"[{record.loss_id}]; shown in `squall status` until `squall cluster "
                f"ack-loss {record.loss_id}`",
            )

    def _on_ack_loss(self, loss_id: str, operator: str, reason: str) -> None:
        """Acknowledge one loss report, audited; an unknown id changes nothing."""
        who = operator or "unknown operator"
        p = self._persisted
        record = next((r for r in p.losses if r.loss_id == loss_id), None)
        if record is None:
            held = ", ".join(r.loss_id for r in p.losses) or "none"
            self._reject(
                RejectCode.NOT_FOUND,
                f"no loss report {_show(loss_id)} on this node (unacknowledged: {held})",
            )
            return
        self._record(who, f"ack-loss {loss_id}", reason or record.summary())
        self._persist(
            losses=tuple(r for r in p.losses if r.loss_id != loss_id),
            acked_loss_ids=(*p.acked_loss_ids, loss_id)[-LOSS_ACKED_IDS_MAX:],
        )
        why = f" ({reason})" if reason else ""
        self._log(
            LogLevel.WARNING,
            "loss-acknowledged",
            f"{LOSS_ACK_MESSAGE_ID} loss report {loss_id} acknowledged by {who}{why}: "
            f"{record.summary()}",
        )

    # ----------------------------------------------------------------- messages

    def _on_message(self, msg: PeerMessage) -> None:
        """Validate the envelope, then dispatch on the body."""
        if msg.to_node != self._me:
            self._reject(
                RejectCode.WRONG_RECIPIENT,
                f"message for node {_show(msg.to_node)} delivered here",
            )
            return
        body = msg.body
        if isinstance(body, Invitation) and self._is_newer(body.membership):
            self._invitation_with_newer_set(msg.from_node, body)
            return
        if msg.from_node in self._removed:
            self._o().rejection = Rejection(
                RejectCode.UNKNOWN_SENDER,
                f"node {self._me}: message from {msg.from_node}, which was removed from the "
                f"cluster (node set {self._membership.describe()})",
            )
            if msg.from_node not in self._removed_logged:
                self._removed_logged.add(msg.from_node)
                self._log(
                    LogLevel.WARNING,
                    "removed-node-heard",
                    f"node {msg.from_node} was removed from the cluster but still runs; its "
                    "messages are refused: stop it, or add it again (squall cluster add-node)",
                )
            return
        if (
            isinstance(body, AreYouCoordinator)
            and msg.from_node not in self._prio
            and (body.membership_epoch, body.membership_version) > self._set_key()
        ):
            # A node added while this one was away probes it: answer, so that it learns this
            # node is here and invites it with the newer node set.
            self._send(msg.from_node, self._probe_reply(with_settings=False))
            return
        if msg.from_node not in self._prio or msg.from_node == self._me:
            self._reject(
                RejectCode.UNKNOWN_SENDER,
                f"message from {_show(msg.from_node)}, which is not another configured node",
            )
            return
        body = msg.body
        frm = msg.from_node
        if self._merge is not None:
            self._merge.heard.add(frm)
        if isinstance(body, AreYouCoordinator):
            self._on_are_you_coordinator(frm, body)
        elif isinstance(body, AreYouCoordinatorReply):
            self._on_are_you_coordinator_reply(frm, body)
        elif isinstance(body, AreYouThere):
            self._on_are_you_there(frm, body)
        elif isinstance(body, AreYouThereReply):
            self._on_are_you_there_reply(frm, body)
        elif isinstance(body, Invitation):
            self._on_invitation(frm, body)
        elif isinstance(body, Accept):
            self._on_accept(frm, body)
        elif isinstance(body, GroupReady):
            self._on_ready(frm, body)
        elif isinstance(body, LeadershipTransfer):
            self._on_transfer(frm, body)
        elif isinstance(body, Leave):
            self._on_leave(frm, body)
        elif isinstance(body, StepAside):
            self._on_step_aside(frm, body)
        else:
            self._on_ready_ack(frm, body)

    def _invitation_with_newer_set(self, frm: str, body: Invitation) -> None:
        """An invitation carrying a newer node set than ours: judge it under that set (its
        sender may be a node we do not know yet); if we do not join, ours stays."""
        newer = body.membership
        if newer is None or frm not in newer.ids or self._me not in newer.ids or frm == self._me:
            self._reject(
                RejectCode.UNKNOWN_SENDER,
                f"invitation from {_show(frm)} carries a node set that does not hold both "
                "the sender and this node",
            )
            return
        before = self._membership
        self._apply_membership(newer)
        self._on_invitation(frm, body)
        if self._group != body.group_name or self._o().rejection is not None:
            self._apply_membership(before)

    def _group_coordinator(self, name: str, frm: str) -> str | None:
        """The coordinator a group name names, or None after rejecting a malformed name."""
        parsed = parse_group_name(name)
        if parsed is None or parsed[0] not in self._prio:
            self._reject(
                RejectCode.MALFORMED_GROUP_NAME,
                f"message from {frm} names group {_show(name)}, which is not "
                "'<configured node id>:<unique id>'",
            )
            return None
        return parsed[0]

    def _check_priority(self, node: str, claimed: int, frm: str) -> bool:
        """Reject a message whose priority disagrees with our configuration."""
        if claimed != self._prio[node]:
            self._reject(
                RejectCode.PRIORITY_MISMATCH,
                f"message from {frm} gives node {node} priority {claimed}, but the "
                f"configuration says {self._prio[node]}; are the config files the same?",
            )
            return False
        return True

    def _on_are_you_coordinator(self, frm: str, body: AreYouCoordinator) -> None:
        """Answer a probe; a probing coordinator below us is a merge candidate."""
        coordinator = self._group_coordinator(body.group_name, frm)
        if coordinator is None:
            return
        if coordinator != frm:
            self._reject(
                RejectCode.MALFORMED_GROUP_NAME,
                f"probe from {frm} for group {_show(body.group_name)}, which {frm} "
                "does not coordinate",
            )
            return
        if not self._cluster_id_ok(body.cluster_id, frm, "probe"):
            return
        version, base = (body.membership_epoch, body.membership_version), body.base_digest
        if self._differs(body.settings_digest, version, base):
            # Refused before its claims are held to our file (its priority may be what
            # differs); it gets our values so that it can name the difference too.
            self._agrees(frm, body.settings_digest, body.settings, version, base)
            self._send(frm, self._probe_reply(with_settings=True))
            return
        # A node holding another version of the node set may know another priority for
        # itself: the invitation settles it.
        same_set = version == self._set_key()
        if same_set and not self._check_priority(frm, body.priority, frm):
            return
        self._learn_designation(frm, body.designated_primary)
        self._send(frm, self._probe_reply(with_settings=False))
        if self._same_cluster(frm, body.cluster_id) and self._agrees(
            frm, body.settings_digest, body.settings, version, base
        ):
            self._note_coordinator(
                frm,
                body.serving,
                older_set=version < self._set_key(),
                never_invites=version > self._set_key() and body.priority == 0,
            )

    def _probe_reply(self, *, with_settings: bool) -> AreYouCoordinatorReply:
        """Our answer to a probe (with our agreed settings for a node that differs)."""
        return AreYouCoordinatorReply(
            self._answers_as_coordinator(),
            self._group,
            self._prio[self._me],
            self._persisted.designated_primary,
            self._cluster_id(),
            serving=self._serving(),
            settings_digest=self._digest,
            settings=self._settings if with_settings else (),
            membership_version=self._membership.version,
            membership_epoch=self._membership.epoch,
            base_digest=self._base_digest,
        )

    def _on_are_you_coordinator_reply(self, frm: str, body: AreYouCoordinatorReply) -> None:
        """A positive answer from a coordinator below us makes it a merge candidate."""
        parsed = parse_group_name(body.group_name)
        if (
            parsed is not None
            and parsed[0] not in self._prio
            and parsed[0] != frm
            and (body.membership_epoch, body.membership_version) != self._set_key()
        ):
            # frm is held in a group whose coordinator is not in our node set (a membership
            # change removed it): nobody else will invite it, so it is a candidate itself.
            if (
                self._cluster_id_ok(body.cluster_id, frm, "probe reply")
                and not self._differs(
                    body.settings_digest,
                    (body.membership_epoch, body.membership_version),
                    body.base_digest,
                )
                and self._same_cluster(frm, body.cluster_id)
            ):
                self._note_coordinator(frm, False)
            return
        coordinator = self._group_coordinator(body.group_name, frm)
        if coordinator is None:
            return
        if body.is_coordinator and coordinator != frm:
            self._reject(
                RejectCode.MALFORMED_GROUP_NAME,
                f"{frm} claims to coordinate group {_show(body.group_name)}, which names "
                f"node {coordinator}",
            )
            return
        if not self._cluster_id_ok(body.cluster_id, frm, "probe reply"):
            return
        version, base = (body.membership_epoch, body.membership_version), body.base_digest
        if self._differs(body.settings_digest, version, base):
            self._agrees(frm, body.settings_digest, body.settings, version, base)
            return
        same_set = version == self._set_key()
        if same_set and not self._check_priority(frm, body.priority, frm):
            return
        self._learn_designation(frm, body.designated_primary)
        if (
            self._same_cluster(frm, body.cluster_id)
            and self._agrees(frm, body.settings_digest, body.settings, version, base)
            and body.is_coordinator
        ):
            self._note_coordinator(
                frm,
                body.serving,
                older_set=version < self._set_key(),
                never_invites=version > self._set_key() and body.priority == 0,
            )

    def _learn_designation(self, node: str, designated: bool) -> None:
        """Track the other node's designated-primary flag (persisted); both set is a
        conflict: the lower-ranked node gives its flag up and stops running alone."""
        self._peer_designated[node] = designated
        holders = tuple(sorted(x for x, flag in self._peer_designated.items() if flag))
        if holders != self._persisted.peer_designated:
            self._persist(peer_designated=holders)
        if not (designated and self._persisted.designated_primary):
            self._conflict_logged = False
            return
        if self._rank_of(self._me) > self._rank_of(node):
            if not self._conflict_logged:
                self._conflict_logged = True
                self._log(
                    LogLevel.ERROR,
                    "designated-primary-conflict",
                    f"node {node} is ALSO designated primary: both may have run alone; "
                    f"{node} ranks lower, so it clears its flag and stops running alone, and "
                    "this node keeps serving; what the two groups wrote apart is decided by "
                    "the newest log when they merge",
                )
            return
        self._designation_conflict(node)

    def _designation_conflict(self, node: str) -> None:
        """Both nodes of a two-node cluster hold the flag, and the other ranks higher: give
        the flag up (audited as ``auto``), record the divergence as a loss report, and stop
        serving alone (the higher-ranked node keeps serving and invites this one)."""
        epoch = self._persisted.epoch
        at_ms = self._now_ms + self._wall_offset_ms
        detail = (
            f"nodes {self._me} and {node} both held the designated-primary flag, so both may "
            f"have run alone and acknowledged writes the other never saw; {self._me} (ranked "
            f"below {node}) cleared its flag and stopped serving alone in epoch {epoch}; when "
            "the two merge, the newest log is kept and the other side's writes since the "
            "split are discarded (the truncating node reports its LSN range and topics)"
        )
        record = LossRecord(
            loss_id=f"loss-{self._me}-dp-{epoch}-{at_ms}",
            node_id=self._me,
            at_ms=at_ms,
            cause="designated-primary-conflict",
            operator_action=f"designated primary set on both {self._me} and {node}",
            detail=detail,
            epoch=epoch,
        )
        self._record("auto", "designated-primary cleared", f"conflict with {node}")
        self._persist(
            designated_primary=False,
            losses=(*self._persisted.losses, record)[-LOSS_RECORDS_MAX:],
        )
        self._log(
            LogLevel.ERROR,
            "designated-primary-conflict",
            f"{LOSS_MESSAGE_ID} acknowledged events may be discarded: {record.summary()} "
            f"[{record.loss_id}]",
        )
        if self._state is NodeState.NORMAL and len(self._view) < 2:
            self._recover(
                f"designated-primary conflict with {node}: stopped running alone",
                LogLevel.ERROR,
            )

    def _on_are_you_there(self, frm: str, body: AreYouThere) -> None:
        """Answer a member's check; it doubles as the member's heartbeat."""
        if self._group_coordinator(body.group_name, frm) is None:
            return
        left = self._left_group
        if (
            left is not None
            and body.group_name == left.group_name
            and body.group_name != self._group
            and frm in left.invited
            and self._now_ms < left.until_ms
        ):
            # Not a "no": this node moved that group on and the invitation is on its way to
            # the member. A "no" arriving first would send it to recovery (IceStorm's rule),
            # and a member ranked above this node (it joined to catch up, or this node was
            # handed the group) would then refuse the invitation from below: the group would
            # re-form without it, only to merge it back later (election seed 50084: five
            # re-formations in 2.4 s). Unanswered, the member takes the invitation, or times
            # out as it would have anyway: its last "yes" came before this node left.
            return
        yes = False
        if body.group_name == self._group and self._coord == self._me:
            if self._state in (NodeState.NORMAL, NodeState.INACTIVE):
                yes = frm in self._members
                if yes:
                    self._members[frm] = self._now_ms
            elif self._merge is not None:
                yes = frm in self._merge.expected or frm in self._merge.accepted
            elif self._reorg is not None:
                yes = frm in self._reorg.members
        held = self._held_reason if yes and self._state is NodeState.INACTIVE else ""
        self._send(frm, AreYouThereReply(body.group_name, yes, held))

    def _leave_group_for(self, group_name: str, invited: Collection[str]) -> None:
        """This coordinator moves the members of ``group_name`` on (``_LeftGroup``)."""
        self._left_group = _LeftGroup(
            group_name,
            frozenset(invited) - {self._me},
            self._now_ms + self._cfg.member_timeout_ms,
        )

    def _on_are_you_there_reply(self, frm: str, body: AreYouThereReply) -> None:
        """Our coordinator's answer: "yes" keeps us in, "no" sends us to recovery."""
        if self._group_coordinator(body.group_name, frm) is None:
            return
        if self._coord == self._me or frm != self._coord or body.group_name != self._group:
            return
        if self._pending is not None:
            return
        if body.yes:
            self._last_yes_ms = self._now_ms
            if body.held_reason != self._held_note:
                self._held_note = body.held_reason
                if body.held_reason:
                    self._last_change_reason = (
                        f"held in {self._group} by coordinator {frm}: {body.held_reason}"
                    )
                    self._log(
                        LogLevel.WARNING,
                        "held",
                        f"coordinator {frm} holds {self._group} without forming it: "
                        f"{body.held_reason}",
                    )
        else:
            group, view, deferred = self._group, self._view, self._deferred
            self._recover(f"coordinator {frm} says this node is not in {self._group}")
            self._succeed(frm, group, view, deferred, invite=False)

    def _on_invitation(self, frm: str, body: Invitation) -> None:
        """Join a group led by a node ranked above our coordinator; forward to our members."""
        inviter = self._group_coordinator(body.group_name, frm)
        if inviter is None:
            return
        carried = body.membership
        version = (carried.epoch, carried.version) if carried is not None else (0, 0)
        if self._differs(body.settings_digest, version, body.base_digest):
            # Before the priority checks: the inviter's priority may be what differs.
            self._agrees(inviter, body.settings_digest, (), version, body.base_digest)
            diffs = self._disagree[inviter][1]
            self._reject(
                RejectCode.FAILED_PRECONDITION,
                f"invitation from {inviter} to {body.group_name} refused: the configuration "
                f"differs ({'; '.join(d.describe(inviter) for d in diffs)})",
            )
            return
        if self._prio[inviter] == 0:
            self._reject(
                RejectCode.INVALID_MESSAGE,
                f"invitation to {_show(body.group_name)} names node {inviter}, which has "
                "priority 0 and never coordinates",
            )
            return
        if not self._cluster_id_ok(body.cluster_id, frm, "invitation"):
            return
        same_set = version == self._set_key()
        if same_set and not self._check_priority(inviter, body.priority, frm):
            return
        # Ranks under another version of the node set are not ours to judge (nor is the
        # inviter's priority, above): a node whose change formed no group while the others
        # formed one under the older set is invited to catch up, which its own set ranks
        # it below (coordinated seed 11432); it joins, and the group takes the newest set.
        bad = [
            x
            for x in body.catch_up
            if x not in self._prio or (same_set and self._rank_of(x) <= self._rank_of(inviter))
        ]
        if bad:
            self._reject(
                RejectCode.INVALID_MESSAGE,
                f"invitation to {_show(body.group_name)} invites {_show(','.join(bad))} to "
                f"catch up, which must be configured nodes ranked above the inviter {inviter}",
            )
            return
        if inviter == self._me or body.group_name == self._group:
            return
        mine = self._cluster_id()
        if body.cluster_id and mine and body.cluster_id != mine:
            self._reject(
                RejectCode.FAILED_PRECONDITION,
                f"invitation from {inviter} to {body.group_name} of cluster "
                f"{_show(body.cluster_id)} refused: this node belongs to cluster {_show(mine)}",
            )
            return
        if self._out_of_groups():
            why = self._out_of_groups_why()
            # Said, not only logged: the inviter hears from this coordinator, so it would
            # otherwise wait member_timeout_ms for an accept that cannot come (chaos seed
            # 89: a successor's merge without a master for 1.1 s). A Leave naming the
            # invited group is what every coordinator already drops an invitee on.
            self._send(
                inviter, Leave(body.group_name, f"node {self._me} is out of every group: {why}")
            )
            self._log(
                LogLevel.INFO,
                "invitation-ignored",
                f"invitation from {inviter} to {body.group_name} ignored: this node is out "
                f"of every group ({why}); told {inviter}",
            )
            return
        current = self._coord
        catching_up = self._catch_up_invitation(frm, body)
        if self._transfer_invitation(inviter, body) or catching_up:
            pass
        elif self._declines_behind(inviter, frm, body):
            return
        elif inviter == current:
            # Our coordinator's new merge carries the epoch we share with it; one that
            # carries an older epoch was delayed from an earlier merge.
            if body.epoch < self._group_epoch:
                self._log(
                    LogLevel.DEBUG,
                    "invitation-ignored",
                    f"invitation to {body.group_name} carries epoch {body.epoch} < "
                    f"{self._group_epoch}: delayed from an older merge",
                )
                return
        elif self._rank_of(inviter) <= self._rank_of(current):
            if (
                frm == inviter
                and current != self._me
                and self._state is NodeState.NORMAL
                and inviter in self._view
            ):
                # A member of our group succeeds a coordinator it lost: we will likely
                # lose it too within a heartbeat, and then join at once (``_succeed``).
                self._deferred = _DeferredInvitation(
                    frm, body, self._now_ms + self._cfg.member_timeout_ms
                )
                self._log(
                    LogLevel.INFO,
                    "invitation-deferred",
                    f"invitation from {inviter} to {body.group_name} kept for "
                    f"{self._cfg.member_timeout_ms} ms: coordinator {current} still answers; "
                    f"taken if this node loses {current} first",
                )
                return
            self._log(
                LogLevel.DEBUG,
                "invitation-ignored",
                f"invitation from {inviter} to {body.group_name} ignored: coordinator "
                f"{current} ranks higher",
            )
            return
        if self._report is None:
            self._log(
                LogLevel.INFO,
                "invitation-ignored",
                f"invitation from {inviter} ignored: the replica has not reported yet",
            )
            return
        forward: set[str] = set()
        if current == self._me:
            if self._merge is not None:
                forward |= self._merge.expected | self._merge.accepted.keys()
            if self._reorg is not None:
                forward |= set(self._reorg.members)
            forward |= self._members.keys()
            forward -= {self._me, inviter}
        forwarded = tuple(sorted(forward, key=node_sort_key))
        for node in forwarded:
            self._send(node, body)
        old_group = self._group
        if current == self._me:
            self._leave_group_for(old_group, forward)
        self._reset_group()
        self._abandon_proposal(f"this node joined {body.group_name} of {inviter}")
        if body.membership != self._membership:
            # The group forms under the inviter's set (a newer one was adopted before the
            # checks): a set of ours only in memory (a change in progress) is dropped.
            self._apply_membership(in_force(self._persisted.membership, self._bootstrap))
        self._state = NodeState.REORGANIZATION
        self._group = body.group_name
        self._coord = inviter
        self._next_probe_ms = None
        self._deactivate_if_active()
        self._pending = _PendingAccept(
            body.group_name, forwarded, self._now_ms + self._cfg.member_timeout_ms
        )
        self._last_change_reason = f"accepted invitation from {inviter} to {body.group_name}"
        # Under this node's own set it may rank below the inviter (an invitation sent under
        # an older set): then it is a member like any other.
        taking_over = (
            catching_up and current == self._me and self._rank_of(self._me) > self._rank_of(inviter)
        )
        if taking_over:
            self._last_change_reason += ", to catch up before taking the lead"
        self._log(
            LogLevel.INFO,
            "catch-up-accepted" if taking_over else "invitation-accepted",
            f"leaving {old_group} for {body.group_name} (coordinator {inviter})"
            + (
                ": it serves; this node catches up as a member, then takes the group over"
                if taking_over
                else ""
            )
            + (f"; forwarded to {','.join(forwarded)}" if forwarded else ""),
        )
        self._try_send_accept()

    def _declines_behind(self, inviter: str, frm: str, body: Invitation) -> bool:
        """Is this the invitation of a node behind our group, which serves nothing? Taken,
        it would make that node master of a group whose newer log it lacks: its replica
        would fetch, and truncate the suffix it wrote as a deposed master (a replay of its
        whole log), while no master serves. Our group's coordinator invites it to catch
        up instead ("Rejoin behaviour"). Its own probes may say otherwise, being older than
        our group (chaos seed 80: a master cut off for 2.5 s came back 130 ms before the
        others formed the next epoch, merged them on older probe answers, and truncated
        for over a second without a master).

        Behind: its invitation carries an epoch below the one this node accepted. The
        coordinator declines it while it serves or is inviting that node to catch up,
        unless that node said it serves in a probe or an answer of the last two probe
        intervals: two serving groups (one kept by an operator's override) still merge,
        once the probes after a heal have said so; what was heard before a cut says
        nothing of now. A member of a group, NORMAL or forming (chaos seed 83: a member
        that had taken its serving coordinator's invitation left for the node behind, and
        that merge waited out member_timeout_ms for it), declines it from the inviter
        itself and takes what its coordinator forwards."""
        if body.epoch >= self._persisted.epoch:
            return False
        if self._coord == self._me:
            catching = self._merge is not None and inviter in self._catch_up
            serving, heard_ms = self._heard_serving.get(inviter, (False, 0))
            lately = self._now_ms - heard_ms <= 2 * self._cfg.probe_interval_ms
            if (serving and lately) or not (self._serving() or catching):
                return False
        elif frm == self._coord or self._state not in (
            NodeState.NORMAL,
            NodeState.REORGANIZATION,
        ):
            return False
        self._log(
            LogLevel.INFO,
            "invitation-declined",
            f"invitation from {inviter} to {body.group_name} declined: it carries epoch "
            f"{body.epoch}, behind this node's {self._persisted.epoch}, and {inviter} serves "
            f"nothing; {self._coord} invites it to catch up instead",
        )
        return True

    def _catch_up_invitation(self, frm: str, body: Invitation) -> bool:
        """Is this a serving group's invitation to catch up that this node takes?

        A coordinator named in it takes it while it serves no group: inactive, or while
        its own merge still collects answers. That merge is most likely the one the
        serving group declined (``_declines_behind``), whose answers never come: waiting
        it out kept the serving group's catch-up merge, and with it every write, waiting
        member_timeout_ms for this node (chaos seed 86: 1 s without a master). Its members
        take it when it forwards it to them (it accepted)."""
        if self._coord == self._me:
            return self._me in body.catch_up and self._state in (
                NodeState.INACTIVE,
                NodeState.ELECTION,
            )
        return frm == self._coord and self._coord in body.catch_up

    def _transfer_invitation(self, inviter: str, body: Invitation) -> bool:
        """Is this the invitation of the node our group is being handed to?

        Members accept it from any member of the group; the coordinator only from the
        target of the transfer it ordered.
        """
        if not body.transfer_group or body.transfer_group != self._group:
            return False
        if self._coord == self._me:
            return self._transfer is not None and self._transfer.target == inviter
        return self._state is NodeState.NORMAL and inviter in self._view

    def _on_transfer(self, frm: str, body: LeadershipTransfer) -> None:
        """Our coordinator hands its group to us: invite its members into a group of ours."""
        coordinator = self._group_coordinator(body.group_name, frm)
        if coordinator is None:
            return
        if coordinator != frm or body.target != self._me:
            self._reject(
                RejectCode.INVALID_MESSAGE,
                f"transfer from {frm} of group {_show(body.group_name)} to "
                f"{_show(body.target)}: only a group's coordinator hands it over, to the "
                "receiver",
            )
            return
        unknown = [x for x in body.members if x not in self._prio]
        if unknown or self._me not in body.members or frm not in body.members:
            self._reject(
                RejectCode.INVALID_MESSAGE,
                f"transfer from {frm} names members {_show(','.join(body.members))}, "
                "which must be configured nodes including both ends of the transfer",
            )
            return
        if not self._eligible:
            self._reject(
                RejectCode.FAILED_PRECONDITION,
                f"transfer from {frm} refused: this node has priority 0 and never leads",
            )
            return
        if (
            self._coord != frm
            or self._group != body.group_name
            or self._state is not NodeState.NORMAL
            or self._group_epoch != body.epoch
        ):
            self._log(
                LogLevel.INFO,
                "transfer-ignored",
                f"transfer of {body.group_name} (epoch {body.epoch}) from {frm} ignored: "
                f"this node is in {self._group} (epoch {self._group_epoch}, "
                f"{self._state.value})",
            )
            return
        self._start_merge({x for x in body.members if x != self._me}, transfer_from=frm)

    def _on_accept(self, frm: str, body: Accept) -> None:
        """Count an acceptance into the group we are forming."""
        coordinator = self._group_coordinator(body.group_name, frm)
        if coordinator is None:
            return
        if body.report.node_id != frm:
            self._reject(
                RejectCode.INVALID_MESSAGE,
                f"accept from {frm} carries a report for node {_show(body.report.node_id)}",
            )
            return
        merge = self._merge
        if (
            coordinator != self._me
            or body.group_name != self._group
            or self._state is not NodeState.ELECTION
            or merge is None
        ):
            self._log(
                LogLevel.DEBUG,
                "accept-ignored",
                f"late or stray accept from {frm} for {body.group_name}",
            )
            return
        merge.accepted[frm] = body.report
        merge.expected.add(frm)
        merge.expected |= {x for x in body.forwarded_to if x in self._prio and x != self._me}
        if merge.pruning:
            self._prune_silent_invitees(merge)
        self._maybe_reorganize()

    def _on_ready(self, frm: str, body: GroupReady) -> None:
        """Persist the group's epoch, follow its coordinator, acknowledge."""
        coordinator = self._group_coordinator(body.group_name, frm)
        if coordinator is None:
            return
        if coordinator != frm or body.coordinator_id != frm:
            self._reject(
                RejectCode.MALFORMED_GROUP_NAME,
                f"Ready from {frm} for group {_show(body.group_name)} names coordinator "
                f"{_show(body.coordinator_id)}",
            )
            return
        members = set(body.members)
        carried = body.membership
        known = set(carried.ids) if carried is not None else set(self._prio)
        if carried is not None and (carried.epoch != body.epoch or self._me not in known):
            self._reject(
                RejectCode.INVALID_MESSAGE,
                f"Ready from {frm} for epoch {body.epoch} carries node set "
                f"{carried.describe()}, which must be of that epoch and hold this node",
            )
            return
        if (
            body.epoch < 1
            or len(members) != len(body.members)
            or not members <= known
            or frm not in members
            or body.sync_source_id not in members
        ):
            self._reject(
                RejectCode.INVALID_MESSAGE,
                f"Ready from {frm} is inconsistent: epoch {body.epoch}, members "
                f"{_show(','.join(body.members))}, sync source {_show(body.sync_source_id)}",
            )
            return
        if not self._cluster_id_ok(body.cluster_id, frm, "Ready"):
            return
        mine = self._cluster_id()
        if body.cluster_id and mine and body.cluster_id != mine:
            self._reject(
                RejectCode.FAILED_PRECONDITION,
                f"Ready from {frm} for {body.group_name} of cluster {_show(body.cluster_id)} "
                f"refused: this node belongs to cluster {_show(mine)}",
            )
            return
        duplicate = (
            self._state is NodeState.NORMAL
            and self._group == body.group_name
            and self._coord == frm
            and self._group_epoch == body.epoch
        )
        if duplicate:
            self._send(frm, GroupReadyAck(body.group_name, body.epoch))
            return
        if body.epoch <= self._persisted.epoch:
            self._reject(
                RejectCode.STALE_EPOCH,
                f"Ready from {frm} for {body.group_name} has epoch {body.epoch}, but this "
                f"node already accepted epoch {self._persisted.epoch}",
            )
            return
        if (
            body.group_name != self._group
            or self._coord != frm
            or self._state is not NodeState.REORGANIZATION
            or self._pending is not None
            or self._me not in members
        ):
            self._log(
                LogLevel.DEBUG,
                "ready-ignored",
                f"Ready from {frm} for {body.group_name} ignored: not our pending group",
            )
            return
        if carried is not None:
            self._apply_membership(carried)
        self._persist(
            epoch=body.epoch,
            max_seen=max(self._persisted.max_seen, body.max_seen, self._voters_in(body.members)),
            cluster_id=body.cluster_id or self._persisted.cluster_id,
            membership=carried if carried is not None else self._persisted.membership,
        )
        self._state = NodeState.NORMAL
        self._group_epoch = body.epoch
        self._view = body.members
        self._sync_source = body.sync_source_id
        self._last_yes_ms = self._now_ms
        self._send(frm, GroupReadyAck(body.group_name, body.epoch))
        self._command(
            RoleCommandKind.FOLLOW,
            epoch=body.epoch,
            master_id=frm,
            members=body.members,
            sync_source_id=body.sync_source_id,
            group_name=body.group_name,
            cluster_id=self._persisted.cluster_id,
            nodes=self._voting_nodes(),
            learners=self._learner_nodes(),
        )
        self._last_change_reason = f"slave of {frm} in {body.group_name}, epoch {body.epoch}"
        self._log(
            LogLevel.INFO,
            "normal",
            f"reporting for duty in {body.group_name} with coordinator {frm}, epoch {body.epoch}",
        )
        self._revert_override_if_majority(body.members, body.epoch)

    def _on_ready_ack(self, frm: str, body: GroupReadyAck) -> None:
        """Count a member's persisted epoch; all in means NORMAL."""
        coordinator = self._group_coordinator(body.group_name, frm)
        if coordinator is None:
            return
        reorg = self._reorg
        if (
            coordinator != self._me
            or body.group_name != self._group
            or reorg is None
            or body.epoch != reorg.epoch
            or frm not in reorg.members
        ):
            return
        reorg.acked.add(frm)
        if len(reorg.acked) == len(reorg.members) - 1:
            self._go_normal()
