"""Publisher-visible gap per fault kind and publish path (issue 14, item 5).

Three nodes from deploy/cluster.example.toml with its default settings, run as real
processes on loopback (replica and coordinator per node, one gateway), 100-byte events.
Three publishers run at once, one per path, each on its own thread and topic, publishing
one event at a time and waiting for each receipt: through the gateway
(`topic.publisher()`), through a replicated proxy (`publisher(replicated=True)`) and
through a non-replicated proxy (`publisher(replicated=False)`). A publisher keeps its id
and sequence across errors: after an error the library did not absorb (for a
non-replicated proxy, `PublisherLost` once its master is gone) it asks for a new
publisher with the same id and sends the same event again with the same sequence, as an
application that must not lose or duplicate an event does.

Each trial hits the master (n1, the highest priority, which takes the lead back after
each heal) with one fault kind while all three publish:

``node_kill``          kill -9 of both of the master node's processes; heal: restart both.
``replica_kill``       kill -9 of the master's replica alone; heal: restart it.
``replica_pause``      SIGSTOP of the master's replica alone; heal: SIGCONT.
``coordinator_kill``   kill -9 of the master's coordinator alone; heal: restart it.
``coordinator_pause``  SIGSTOP of the master's coordinator alone; heal: SIGCONT.
``replica_term``       SIGTERM of the master's replica alone (``systemctl restart`` of
                       one unit: the process drains its calls, up to 1 s, and exits);
                       heal: restart it.
``coordinator_term``   SIGTERM of the master's coordinator alone; heal: restart it.
``lead_back``          measured on every node_kill trial's heal: the restarted n1
                       rejoins as a slave of the node elected meanwhile, catches up, and
                       is handed the master role (docs/architecture.md, "Rejoin").

A trial: wait until the cluster is normal (every coordinator NORMAL in one group, its
master's replica master) and every path has `STEADY_ACKS` receipts from that master;
inject the fault (timed from the moment it is in place: the killed process reaped, the
SIGSTOP or SIGTERM sent); hold it `HOLD_S` (several member timeouts and leases: a coordinator's
fault stops nothing at once, its node fails over when the leases run out); heal it; wait
(at most `RECOVER_S`) until every path has a receipt for a publish sent after the fault
started and one at or after the heal. Per path, as the chaos checker defines them
(`chaos.checker.fault_window`): **first_ack** — from the fault to the first receipt of a
publish sent after it; **longest_gap** — the longest interval with no receipt from the
fault to the first receipt at or after the heal. A path with no receipt by the bound is
counted *not recovered* (the trial goes on); one whose first receipt came only after the
heal is counted *after heal*: Squall did not fail over within `HOLD_S`, and the gap is
as long as the fault was held. For lead_back: first_ack is the time from the last
receipt before the first one from n1 to that one, longest_gap the longest interval with
no receipt from the restart to the first receipt from n1.

The cluster is reused across a kind's trials (each heal restarts or resumes what the
fault stopped and the next trial waits until the cluster is normal again); each kind gets
a fresh cluster. At the end of a kind the publishers stop and every topic is read back
from the earliest offset: every acknowledged event must be stored at the offset of its
receipt with its payload (`lost` counts those that are not), and no event twice.

Every loop has a count or a deadline.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

import squall
from bench import publish_gap, replicated, single_node
from chaos.checker import fault_window
from deploy import processes

KINDS = (
    "node_kill",
    "replica_kill",
    "replica_pause",
    "coordinator_kill",
    "coordinator_pause",
    "replica_term",
    "coordinator_term",
    "lead_back",
)
# The kinds a trial injects; lead_back is measured on node_kill's heal.
INJECTED = KINDS[:-1]
PATHS = ("gateway", "replicated", "non_replicated")
WHAT = {
    "node_kill": "kill -9 of the master node (replica and coordinator); restart both",
    "replica_kill": "kill -9 of the master's replica alone; restart it",
    "replica_pause": "SIGSTOP of the master's replica alone; SIGCONT",
    "coordinator_kill": "kill -9 of the master's coordinator alone; restart it",
    "coordinator_pause": "SIGSTOP of the master's coordinator alone; SIGCONT",
    "replica_term": "SIGTERM of the master's replica alone (it drains, then exits); restart it",
    "coordinator_term": "SIGTERM of the master's coordinator alone; restart it",
    "lead_back": "the restarted n1 (highest priority) takes the master role back",
}
AIM = "p50 <= 500 ms and max <= 1000 ms for every kind and path, default settings"
AIM_P50_MS = 500.0
AIM_MAX_MS = 1000.0
TRIALS_DEFAULT = 20
# How long every fault is held before it is healed: 3x the aim's max and many member
# timeouts (400 ms), so a failover Squall makes happens while it lasts, and a path whose
# first receipt comes only after the heal shows that Squall did not fail over.
HOLD_S = 3.0
# After the heal, longest wait for every path's receipt; past it: not recovered.
RECOVER_S = 20.0
STEADY_ACKS = 10
STEADY_TIMEOUT_S = 30.0
# A publisher that cannot get a new publisher waits this long before asking again.
RETRY_PAUSE_S = 0.02
# Each publisher's loop bound (events plus attempts to get a publisher).
STEPS_MAX = 10_000_000
READ_BACK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Ack:
    """One acknowledged publish: when it was sent and acknowledged, by which master,
    where the receipt says the event is, and what was sent."""

    invoked: float
    acked: float
    master: str
    offset: int
    payload: bytes
    duplicate: bool


def payload(path: str, sequence: int) -> bytes:
    """The event a path's publisher sends with a sequence: unique, 100 bytes."""
    return f"{path}:{sequence}:".encode().ljust(single_node.EVENT_BYTES, b"x")


class PathPublisher(threading.Thread):
    """Publishes one event at a time on one path until stopped (module docstring)."""

    def __init__(self, address: str, topic: str, path: str) -> None:
        super().__init__(daemon=True, name=f"gap-{path}")
        self.address = address
        self.topic = topic
        self.path = path
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.acks: list[Ack] = []
        self.failures: list[tuple[float, str]] = []
        self.error: BaseException | None = None
        self._publisher_id = f"bench-gap-{path}-{os.getpid()}-{topic}"

    def run(self) -> None:
        replicated_kind = {"gateway": None, "replicated": True, "non_replicated": False}
        sequence = 1
        publisher: squall.Publisher | None = None
        try:
            with squall.connect(self.address) as client:
                topic = client.topic(self.topic)
                for _ in range(STEPS_MAX):
                    if self.stop.is_set():
                        break
                    event = payload(self.path, sequence)
                    invoked = time.monotonic()
                    try:
                        if publisher is None:
                            publisher = topic.publisher(
                                self._publisher_id,
                                start_sequence=sequence,
                                replicated=replicated_kind[self.path],
                            )
                        receipt = publisher.publish(event)
                    except (squall.SquallError, grpc.RpcError) as exc:
                        # Not absorbed by the library: a new publisher, the same event
                        # and sequence again (the master stores it once).
                        with self.cond:
                            self.failures.append((time.monotonic(), repr(exc)))
                        _close(publisher)
                        publisher = None
                        self.stop.wait(RETRY_PAUSE_S)
                        continue
                    with self.cond:
                        self.acks.append(
                            Ack(
                                invoked,
                                time.monotonic(),
                                receipt.master_id,
                                receipt.offset,
                                event,
                                receipt.duplicate,
                            )
                        )
                        self.cond.notify_all()
                    sequence += 1
        except BaseException as exc:  # reported by the trial
            self.error = exc
        finally:
            _close(publisher)
            with self.cond:
                self.cond.notify_all()

    def snapshot(self) -> list[Ack]:
        with self.cond:
            return list(self.acks)


def _close(publisher: squall.Publisher | None) -> None:
    if publisher is not None:
        try:
            publisher.close()
        except Exception:  # a broken publisher's close must not stop the run
            pass


@dataclass
class _Group:
    """The three paths' publishers, and a wait on all of them."""

    publishers: list[PathPublisher]
    cond: threading.Condition = field(default_factory=threading.Condition)

    def wait_all(self, predicate: Callable[[PathPublisher], bool], timeout_s: float) -> bool:
        """Whether every publisher satisfies predicate within timeout_s (woken by receipts)."""
        deadline = time.monotonic() + timeout_s
        for publisher in self.publishers:
            with publisher.cond:
                # Bounded by the deadline.
                while not predicate(publisher):
                    if publisher.error is not None:
                        raise RuntimeError(
                            f"the {publisher.path} publisher failed: {publisher.error!r}"
                        ) from publisher.error
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    publisher.cond.wait(min(left, 0.1))
        return True


# --- faults on one process (the failover bench's cluster has whole-node kills only)


def _kill(cluster: replicated._Bench, kind: str, node_id: str) -> None:
    processes.kill_service(cluster.services[(kind, node_id)])


def _start(cluster: replicated._Bench, kind: str, node_id: str) -> None:
    node = cluster.config.node(node_id)
    address = node.replica_address if kind == "replica" else node.coordinator_address
    service = processes.start_service(
        kind,
        cluster.config_path,
        node_id,
        address,
        cluster.run_dir / "logs" / f"{kind}-{node_id}.log",
    )
    cluster.services[(kind, node_id)] = service
    processes.wait_serving([service])


def _signal(cluster: replicated._Bench, kind: str, node_id: str, signum: int) -> None:
    service = cluster.services[(kind, node_id)]
    if service.process.poll() is None:
        os.kill(service.pid, signum)


def inject(cluster: replicated._Bench, kind: str, victim: str) -> None:
    """Starts one fault on the victim node."""
    if kind == "node_kill":
        cluster.kill_node(victim)
    elif kind in ("replica_kill", "coordinator_kill"):
        _kill(cluster, kind.split("_")[0], victim)
    elif kind in ("replica_pause", "coordinator_pause"):
        _signal(cluster, kind.split("_")[0], victim, signal.SIGSTOP)
    elif kind in ("replica_term", "coordinator_term"):
        # In place once sent: the process's own stop (its drain) is part of the fault.
        _signal(cluster, kind.split("_")[0], victim, signal.SIGTERM)
    else:
        raise ValueError(f"no injected fault kind {kind!r}")


def heal(cluster: replicated._Bench, kind: str, victim: str) -> None:
    """Ends one fault: restarts what was killed (waits until it serves), resumes what
    was stopped."""
    if kind == "node_kill":
        cluster.start_node(victim)
    elif kind in ("replica_kill", "coordinator_kill"):
        _start(cluster, kind.split("_")[0], victim)
    elif kind in ("replica_pause", "coordinator_pause"):
        _signal(cluster, kind.split("_")[0], victim, signal.SIGCONT)
    elif kind in ("replica_term", "coordinator_term"):
        process = kind.split("_")[0]
        # Exited during the hold; reaped here (killed if it outlived stop_service's wait).
        processes.stop_service(cluster.services[(process, victim)])
        _start(cluster, process, victim)
    else:
        raise ValueError(f"no injected fault kind {kind!r}")


# --- the windows


def window(acks: Sequence[Ack], start: float, healed: float, horizon: float) -> dict[str, Any]:
    """One path's figures for one fault (module docstring), in ms; None: not recovered."""
    pairs = sorted((a.acked, a.invoked) for a in acks)
    first, longest, recovered = fault_window(pairs, start, healed, horizon)
    ok = first is not None and recovered
    return {
        "first_ack_ms": round(first * 1000, 1) if ok and first is not None else None,
        "longest_gap_ms": round(longest * 1000, 1) if ok else None,
        "after_heal": ok and first is not None and start + first >= healed,
    }


def lead_back_window(acks: Sequence[Ack], restarted: float, leader: str) -> dict[str, Any]:
    """One path's figures for the leader taking its role back (module docstring)."""
    ordered = sorted(acks, key=lambda a: a.acked)
    index = next(
        (i for i, a in enumerate(ordered) if a.acked > restarted and a.master == leader), None
    )
    if index is None:
        return {"first_ack_ms": None, "longest_gap_ms": None, "after_heal": False}
    back = ordered[index].acked
    before = ordered[index - 1].acked if index > 0 else restarted
    marks = [restarted, *(a.acked for a in ordered[:index] if a.acked > restarted), back]
    longest = max(b - a for a, b in itertools.pairwise(marks))
    return {
        "first_ack_ms": round((back - before) * 1000, 1),
        "longest_gap_ms": round(longest * 1000, 1),
        "after_heal": False,
    }


def _recovered(publisher: PathPublisher, since: float) -> bool:
    """A receipt at or after since (the newest receipt is the latest)."""
    return bool(publisher.acks) and publisher.acks[-1].acked >= since


def _sent_after(publisher: PathPublisher, since: float) -> bool:
    """A receipt for a publish sent at or after since (newest first: a receipt that
    arrived before since ends the search)."""
    for ack in reversed(publisher.acks):
        if ack.acked < since:
            return False
        if ack.invoked >= since:
            return True
    return False


def _closed(publisher: PathPublisher, started: float, healed: float) -> bool:
    """Both of a path's windows can be measured: a receipt for a publish sent after the
    fault started, and one at or after the heal."""
    return _recovered(publisher, healed) and _sent_after(publisher, started)


def _from(publisher: PathPublisher, leader: str, since: float, count: int) -> bool:
    """At least count receipts from leader after since (newest first)."""
    seen = 0
    for ack in reversed(publisher.acks):
        if ack.acked <= since:
            return False
        seen += ack.master == leader
        if seen >= count:
            return True
    return False


# --- one kind


def _empty(kinds: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {
        kind: {
            "what": WHAT[kind],
            "trials": 0,
            "paths": {
                path: {
                    "first_ack_ms": [],
                    "longest_gap_ms": [],
                    "not_recovered": 0,
                    "after_heal": 0,
                }
                for path in PATHS
            },
            "failed_calls": {path: 0 for path in PATHS},
            "error": None,
        }
        for kind in kinds
    }


def _note(figures: dict[str, Any], path: str, one: dict[str, Any]) -> None:
    row = figures["paths"][path]
    if one["first_ack_ms"] is None:
        row["not_recovered"] += 1
        return
    row["first_ack_ms"].append(one["first_ack_ms"])
    row["longest_gap_ms"].append(one["longest_gap_ms"])
    row["after_heal"] += 1 if one["after_heal"] else 0


def prefill(address: str, events: int, log: Callable[[str], None]) -> None:
    """Lengthen the log before the trials: `events` publishes, one log entry each
    (pipelined one event per request), on a topic of their own. A lead back that must
    truncate a divergent suffix replays the whole log (docs/replication.md, *Truncation*),
    so its gap is measured with a long log and a short one."""
    if events <= 0:
        return
    began = time.monotonic()
    with squall.connect(address) as client:
        client.create_topic("bench-gap-prefill")
        with client.topic("bench-gap-prefill").publisher() as publisher:
            publisher.publish_many(single_node.payloads(events), batch_events=1)
    log(f"  prefill: {events} entries in {time.monotonic() - began:.1f} s")


def run_kind(
    kind: str,
    trials: int,
    temp: Path,
    results: dict[str, dict[str, Any]],
    log: Callable[[str], None],
    prefill_events: int = 0,
) -> dict[str, Any]:
    """`trials` trials of one injected kind on a fresh cluster (and lead_back's for
    node_kill), after `prefill_events` log entries; fills results[kind] (and
    results["lead_back"]); returns the read-back."""
    figures = results[kind]
    lead = results.get("lead_back") if kind == "node_kill" else None
    topics = {path: f"bench-gap-{kind}-{path}" for path in PATHS}
    paused: list[tuple[str, str]] = []
    with replicated.running(temp / kind) as cluster:
        address = cluster.gateway_address
        with squall.connect(address) as client:
            for topic in topics.values():
                client.create_topic(topic)
        prefill(address, prefill_events, log)
        group = _Group([PathPublisher(address, topics[path], path) for path in PATHS])
        for publisher in group.publishers:
            publisher.start()
        try:
            for trial in range(trials):
                victim = publish_gap.settle(cluster)
                began = time.monotonic()
                if not group.wait_all(
                    functools.partial(_from, leader=victim, since=began, count=STEADY_ACKS),
                    STEADY_TIMEOUT_S,
                ):
                    raise TimeoutError(f"publishers not steady on {victim} in {STEADY_TIMEOUT_S} s")
                failures_before = {p.path: len(p.failures) for p in group.publishers}
                inject(cluster, kind, victim)
                # From the moment the fault is in place (a kill returns once the process
                # is reaped): a receipt the victim sent while being killed is not the
                # next acknowledged publish.
                started = time.monotonic()
                if kind.endswith("_pause"):
                    paused.append((kind.split("_")[0], victim))
                # Held for a fixed time: a fault that does not stop publishing at once
                # (a coordinator's) fails the node over only when the leases run out.
                time.sleep(HOLD_S)
                healed = time.monotonic()
                heal(cluster, kind, victim)
                paused.clear()
                group.wait_all(
                    functools.partial(_closed, started=started, healed=healed), RECOVER_S
                )
                horizon = time.monotonic()
                cells = []
                for publisher in group.publishers:
                    one = window(publisher.snapshot(), started, healed, horizon)
                    _note(figures, publisher.path, one)
                    figures["failed_calls"][publisher.path] += (
                        len(publisher.failures) - failures_before[publisher.path]
                    )
                    cells.append(f"{publisher.path} {_cell(one)}")
                figures["trials"] += 1
                log(
                    f"  {kind} {trial + 1}/{trials} ({victim}, first ack / longest gap): "
                    + ", ".join(cells)
                )
                if lead is not None:
                    group.wait_all(
                        functools.partial(_from, leader=victim, since=healed, count=1), RECOVER_S
                    )
                    cells = []
                    for publisher in group.publishers:
                        one = lead_back_window(publisher.snapshot(), healed, victim)
                        _note(lead, publisher.path, one)
                        cells.append(f"{publisher.path} {_cell(one)}")
                    lead["trials"] += 1
                    log(f"  lead_back {trial + 1}/{trials} ({victim}): " + ", ".join(cells))
        except (TimeoutError, RuntimeError) as exc:
            figures["error"] = f"{type(exc).__name__}: {exc}"
            log(f"  {kind}: stopped after {figures['trials']} trials: {exc}")
        finally:
            for process, node_id in paused:
                _signal(cluster, process, node_id, signal.SIGCONT)
            for publisher in group.publishers:
                publisher.stop.set()
            for publisher in group.publishers:
                publisher.join(30)
        try:
            publish_gap.settle(cluster)
        except TimeoutError as exc:
            figures["error"] = figures["error"] or f"TimeoutError: {exc}"
        return read_back(address, group.publishers)


def _cell(one: dict[str, Any]) -> str:
    if one["first_ack_ms"] is None:
        return "NOT recovered"
    text = f"{one['first_ack_ms']:.0f}/{one['longest_gap_ms']:.0f} ms"
    return text + " (after heal)" if one["after_heal"] else text


def read_back(address: str, publishers: Sequence[PathPublisher]) -> dict[str, Any]:
    """Reads every path's topic from the earliest offset: acknowledged events not stored
    at their receipt's offset with their payload (lost), and events stored twice."""
    figures: dict[str, Any] = {"acknowledged": 0, "lost": 0, "stored_twice": 0, "examples": []}
    with squall.connect(address) as client:
        for publisher in publishers:
            stored: dict[int, bytes] = {}
            deadline = time.monotonic() + READ_BACK_TIMEOUT_S
            subscription = client.topic(publisher.topic).subscribe(start="earliest", follow=False)
            try:
                for message in subscription:
                    stored[message.offset] = message.payload
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"reading {publisher.topic} back took too long")
            finally:
                subscription.close()
            acks = publisher.snapshot()
            figures["acknowledged"] += len(acks)
            for ack in acks:
                if stored.get(ack.offset) != ack.payload:
                    figures["lost"] += 1
                    if len(figures["examples"]) < 5:
                        figures["examples"].append(
                            f"{publisher.path}: {ack.payload[:24]!r} acked at offset {ack.offset}"
                        )
            values = list(stored.values())
            figures["stored_twice"] += len(values) - len(set(values))
    return figures


def run(
    trials: int,
    temp: Path,
    log: Callable[[str], None],
    kinds: Sequence[str] = INJECTED,
    prefill_events: int = 0,
) -> dict[str, Any]:
    """Every injected kind asked for (`trials` each; node_kill's heals give lead_back's),
    each cluster's log first lengthened by `prefill_events` entries."""
    unknown = [k for k in kinds if k not in INJECTED]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}; known: {list(INJECTED)}")
    measured = [k for k in INJECTED if k in kinds]
    results = _empty([*measured, *(["lead_back"] if "node_kill" in measured else [])])
    read: dict[str, Any] = {"acknowledged": 0, "lost": 0, "stored_twice": 0, "examples": []}
    for kind in measured:
        log(f"bench: fault gaps, {kind} ({WHAT[kind]}), {trials} trials")
        back = run_kind(kind, trials, temp, results, log, prefill_events)
        results[kind]["read_back"] = back
        for key in ("acknowledged", "lost", "stored_twice"):
            read[key] += back[key]
        read["examples"] += back["examples"][:5]
    return {
        "aim": AIM,
        "aim_p50_ms": AIM_P50_MS,
        "aim_max_ms": AIM_MAX_MS,
        "template": "deploy/cluster.example.toml",
        "trials": trials,
        "prefill_events": prefill_events,
        "hold_s": HOLD_S,
        "recover_s": RECOVER_S,
        "paths": list(PATHS),
        "kinds": results,
        "read_back": read,
    }
