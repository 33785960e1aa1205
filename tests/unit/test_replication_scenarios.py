"""The replication protocol as readable transcripts: one ``ReplicationMaster`` and real
``Follower`` machines (``services/replica/replication.py``, ``follower.py``) exchanging
hellos, positions, batches, heartbeats and acks, every message and decision printed.

The machines are driven by the in-memory ``Cluster`` of ``tests/unit/test_replication.py``
(one twin driver for both tests, applying every ``Actions`` record in its documented
order); this module only prints what crosses the streams. Files are under
tests/unit/scenarios/replication/, in the format of ``tests/unit/transcripts.py``;
regenerate them with ``SQUALL_REWRITE=1 .venv/bin/pytest tests/unit/test_replication_scenarios.py``
and review the diff like code.

Commands (the master is node 1; a log is written ``E:L[,E:L]``: entries of epoch E up
to LSN L):
    cluster nodes=1,2,3 [epoch=2] [acks=majority|all|none]
            [replica_sync=sync|write_no_sync|no_sync] [window=4]
            [log1=1:3] [log2=1:3] [log3=1:2]
    start                   node 1 appends its epoch-start entry and opens each stream
    write n=3               node 1 appends 3 entries, each a client write w<LSN>
    run                     deliver every message until nothing moves
    pause 3 / resume 3      node 3 stops (starts) reading its stream
    disconnect 3 / connect 3
                            node 3's stream breaks / a new one opens (a new Hello)
    compact from=N          node 1's log now starts at LSN N (older entries deleted)
    tick ms=N               the master's clock reads N; heartbeats go out
    depose reason=why       the coordinator took the role away
    status                  commit LSN, each slave's state and log end
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from squall_server.replica.follower import HelloAccepted
from squall_server.replica.replication import Ack, AckPolicy, Actions, SyncPolicy
from tests.unit.test_replication import Batch, Cluster, Entry, Heartbeat, Hello, Snapshot, entry
from tests.unit.transcripts import check_or_rewrite, parse_transcript, render

SCENARIOS = Path(__file__).parent / "scenarios" / "replication"
ACKS = {"majority": AckPolicy.MAJORITY, "all": AckPolicy.ALL, "none": AckPolicy.NONE}
SYNCS = {
    "sync": SyncPolicy.SYNC,
    "write_no_sync": SyncPolicy.WRITE_NO_SYNC,
    "no_sync": SyncPolicy.NO_SYNC,
}


def log_of(spec: str) -> list[Entry]:
    """``1:3,2:5``: LSNs 1-3 of epoch 1, then 4-5 of epoch 2."""
    out: list[Entry] = []
    for part in filter(None, spec.split(",")):
        epoch, _, last = part.partition(":")
        out.extend(entry(lsn, int(epoch)) for lsn in range(len(out) + 1, int(last) + 1))
    return out


def lsns(entries: list[Entry]) -> str:
    return f"{entries[0].lsn}..{entries[-1].lsn}" if entries else "none"


class TracedCluster(Cluster):
    """The test_replication cluster, printing every message and every decision."""

    out: list[str]

    def say(self, line: str) -> None:
        self.out.append(line)

    def apply(self, actions: Actions[str]) -> None:
        before = self.commits[-1]
        super().apply(actions)
        if actions.rejection is not None:
            r = actions.rejection
            self.say(f"  master rejected {r.code.value}: {r.message}")
        if actions.commit_lsn != before:
            self.say(f"  commit {before} -> {actions.commit_lsn}")
        for node in actions.snapshots:
            self.say(f"  snapshot for {node}")
        if actions.completed:
            self.say(f"  completed {','.join(actions.completed)}")
        if actions.failed:
            self.say(f"  failed (indeterminate) {','.join(actions.failed)}")
        if actions.deposed:
            self.say(f"  deposed: {actions.deposed}")
        for event in actions.events:
            self.say(f"  event: {event}")

    def deliver_to_slave(self, node: str) -> bool:
        slave = self.slaves[node]
        if slave.paused or not slave.inbox:
            return False
        msg = slave.inbox[0]
        if isinstance(msg, Hello):
            text = f"Hello epoch={msg.epoch}"
        elif isinstance(msg, Batch):
            truncate = (
                f" truncate-after={msg.truncate_after_lsn}"
                if msg.truncate_after_lsn is not None
                else ""
            )
            text = f"Batch lsn={lsns(msg.entries)} commit={msg.commit_lsn}{truncate}"
        elif isinstance(msg, Heartbeat):
            text = f"Heartbeat commit={msg.commit_lsn}"
        else:
            assert isinstance(msg, Snapshot)
            text = f"Snapshot lsn={msg.snapshot_lsn}"
        self.say(f"1->{node} {text} (stream {msg.stream_id})")
        refusals = len(slave.refusals)
        moved = super().deliver_to_slave(node)
        for refusal in slave.refusals[refusals:]:
            self.say(f"  {node} refused {refusal.code.value}: {refusal.message}")
        return moved

    def deliver_to_master(self) -> bool:
        if not self.to_master:
            return False
        node, _stream, msg = self.to_master[0]
        if isinstance(msg, HelloAccepted):
            p = msg.position
            history = ",".join(f"{e}@{s}" for e, s in p.history) or "-"
            self.say(f"{node}->1 Position log={p.last_epoch}/{p.last_lsn} history={history}")
        else:
            assert isinstance(msg, Ack)
            self.say(
                f"{node}->1 Ack received={msg.received_lsn} written={msg.written_lsn} "
                f"synced={msg.synced_lsn}"
            )
        return super().deliver_to_master()

    def status(self) -> list[str]:
        lines = [
            f"master: epoch={self.epoch} log={self.log_start}..{len(self.log)} "
            f"commit={self.master.commit_lsn}"
        ]
        for node, slave in self.slaves.items():
            p = self.master.progress(node)
            paused = " paused" if slave.paused else ""
            lines.append(
                f"{node}: {p.state.value} log={len(slave.log)} acked={p.received_lsn}/"
                f"{p.written_lsn}/{p.synced_lsn}{paused}"
            )
        return lines


def execute(c: TracedCluster | None, line: str) -> tuple[TracedCluster | None, list[str]]:
    """Run one transcript command; return the (possibly new) cluster and its output."""
    words = shlex.split(line)
    command, args = words[0], words[1:]
    positional = [a for a in args if "=" not in a]
    options = dict(a.split("=", 1) for a in args if "=" in a)
    if command == "cluster":
        nodes = tuple(options.get("nodes", "1,2,3").split(","))
        c = TracedCluster(
            nodes=nodes,
            acks=ACKS[options.get("acks", "majority")],
            replica_sync=SYNCS[options.get("replica_sync", "write_no_sync")],
            window_entries=int(options.get("window", "4")),
            epoch=int(options.get("epoch", "2")),
            master_log=log_of(options.get("log1", "")),
            slave_logs={n: log_of(options.get(f"log{n}", "")) for n in nodes if n != "1"},
        )
        c.out = []
        return c, c.status()
    if c is None:
        raise ValueError(f"{command}: no cluster yet")
    c.out = []
    if command == "start":
        c.start()
    elif command == "write":
        c.append(int(options.get("n", "1")))
        c.say(f"1 log now {len(c.log)}")
    elif command == "run":
        c.run()
    elif command in ("pause", "resume"):
        c.slaves[positional[0]].paused = command == "pause"
    elif command == "disconnect":
        c.disconnect(positional[0])
    elif command == "connect":
        c.connect(positional[0])
    elif command == "compact":
        c.compact(int(options["from"]))
        c.say(f"1 log starts at {c.log_start}")
    elif command == "tick":
        c.apply(c.master.tick(int(options["ms"])))
    elif command == "depose":
        c.apply(c.master.depose(options["reason"]))
    elif command == "status":
        return c, c.status()
    else:
        raise ValueError(f"unknown command {command!r}")
    return c, c.out


def scenario_files() -> list[Path]:
    """Every replication transcript, sorted."""
    return sorted(SCENARIOS.glob("*.txt"))


def test_there_are_replication_scenarios() -> None:
    """The parametrized test below must not pass by finding no files."""
    assert len(scenario_files()) >= 2


@pytest.mark.parametrize("path", scenario_files(), ids=lambda p: p.stem)
def test_replication_scenario(path: Path) -> None:
    """Replays a transcript; SQUALL_REWRITE=1 rewrites it with the actual output."""
    text = path.read_text()
    blocks = parse_transcript(text)
    cluster: TracedCluster | None = None
    outputs: list[list[str]] = []
    for block in blocks:
        cluster, output = execute(cluster, block.command)
        outputs.append(output)
    check_or_rewrite(path, text, render(blocks, outputs))
