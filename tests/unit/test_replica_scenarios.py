"""The replica-role protocol as readable transcripts: role commands, ticks and the driver's
reports in, ``ReplicaCore`` effects out (``services/replica/core.py``).

Each file under tests/unit/scenarios/replica/ is a list of blocks in the format of
``tests/unit/transcripts.py``. The test replays every command on one ``ReplicaCore`` with a
driver twin that applies its effects to a store twin (the epoch and cluster id the rules
read). After an intended change of behaviour, regenerate the files with
``SQUALL_REWRITE=1 .venv/bin/pytest tests/unit/test_replica_scenarios.py`` and review the
diff like code.

Commands (time only moves with ``tick``):
    replica n2 nodes=n1,n2,n3 [epoch=N] [cluster=C]
                              a started replica of node n2, its store at epoch N
    role master|slave|inactive|<number> [epoch=N] [master=n1] [members=n1,n2] [sync=n1]
         [seq=N] [lease=MS] [cluster=C] [reason=why]
                              the coordinator's SetRole; a slave role is followed at once
                              unless ``follow=fails`` (the follower cannot be made)
    taken N                   the background task made the master of epoch N
    finished N [error=CODE:message]
                              the attempt to take epoch N's master role ended
    answer N                  the SetRole that waited for it saw it end
    tick ms=N                 N ms pass; the core is ticked
    deposed reason=why        the replication core deposed this master
    failstop reason=why       a store write failed
    drop reason=why           the driver drops the role for its own reason
    freeze S / finish S / abort S
                              cluster shutdown S
    fence target=n3 epoch=N ms=M / unfence epoch=N
                              a leadership transfer's write fence for M ms
    write                     the write gate's answer now

The log's position and commit-LSN record (the slave side, and every append):
    replica ... [last=N] [start=N] [recorded=N] [retention=N]
                              the store's log ends at N, starts at N, recorded commit N;
                              the node keeps ``retention`` entries
    written last=N batch-commit=N commit=N [synced]
                              a slave stored a batch up to N; the follower's commit LSN
                              is ``commit`` (its ack: the follower's when it accepted
                              those entries, else received = written = N)
    batch stream=N epoch=N [entries=LSN:EPOCH,...] [commit=N] [truncate=N] [bad=LSN]
                              a batch on stream N (``bad``: that entry's checksum is wrong)
    snapshot stream=N index=N lsn=N epoch=N [last] [history=EPOCH:LSN,...]
                              a snapshot chunk on stream N
    heartbeat commit=N [ack=N]
                              an idle stream's heartbeat; the follower's commit LSN
    heartbeat stream=N epoch=N commit=N
                              a heartbeat message on stream N, put to the follower
    recorded N / record-failed
                              the background commit record ended
    appended last=N [recorded=N] / truncated keep=N start=N / compacted start=N
    snapshot-begun / snapshot-installed lsn=N commit=N
    reset last=N start=N [recorded=N]
                              the driver re-read the store
    hello master=n1 epoch=N cluster=C [store-last=N]
                              a master opens a replication stream (the store's log ends
                              at ``store-last``, by default where the core says)
    stream N                  is stream N the current one?
"""

from __future__ import annotations

import shlex
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from squall_server.common.errors import Code
from squall_server.replica.core import (
    CoreConfig,
    Effects,
    LogPosition,
    ReplicaCore,
    Role,
    RoleOrder,
    RoleRefusal,
    StoreFacts,
)
from squall_server.replica.follower import Follower, FollowerConfig
from squall_server.replica.replication import Ack
from tests.unit.transcripts import check_or_rewrite, parse_transcript, render

SCENARIOS = Path(__file__).parent / "scenarios" / "replica"
ROLE_WORDS = {"master": Role.MASTER, "slave": Role.SLAVE, "inactive": Role.INACTIVE}


class Harness:
    """One replica core, its driver twin and its store twin."""

    def __init__(
        self,
        node_id: str,
        nodes: list[str],
        epoch: int,
        cluster_id: str,
        log: LogPosition | None = None,
        retention: int = 0,
    ) -> None:
        addresses = {n: f"127.0.0.1:{7100 + i}" for i, n in enumerate(nodes)}
        self.core = ReplicaCore(
            CoreConfig(node_id, addresses, retention), stored_epoch=epoch, log=log
        )
        self.store = StoreFacts(epoch, cluster_id)
        self.now_ms = 0
        self.follow_fails = False

    def effects(self, effects: Effects) -> list[str]:
        """Applies effects as the driver does, in their documented order; says what."""
        out: list[str] = []
        if effects.role_changed:
            out.append(f"role-changed to {self.core.role.name.lower()}")
        if effects.cancel_taking:
            out.append(f"cancel-taking: {effects.cancel_taking}")
        if effects.thawed:
            out.append(f"thawed: {effects.thawed}")
        if effects.log_reread:
            out.append("log-reread")
        if effects.refusal is not None:
            out.append(("(warning) " if effects.warn else "") + refused(effects.refusal))
            return out
        accepted = effects.batch
        if accepted is not None:
            lsns = [e.lsn for e in accepted.entries]
            span = f"{lsns[0]}..{lsns[-1]}" if lsns else "none"
            out.append(
                f"write entries={span} truncate-after={accepted.truncate_after_lsn} "
                f"sync={accepted.sync}"
            )
        snapshot = effects.snapshot
        if snapshot is not None:
            out.append(
                f"snapshot chunk {snapshot.index} at LSN {snapshot.snapshot_lsn}: "
                + ("install" if snapshot.install else "stage")
            )
        hello = effects.hello
        if hello is not None:
            p = hello.position
            out.append(
                f"hello accepted: stream={effects.stream} position last_epoch={p.last_epoch} "
                f"last_lsn={p.last_lsn}"
                + (f" adopt-cluster-id={hello.adopt_cluster_id}" if hello.adopt_cluster_id else "")
            )
        if effects.drop_role:
            out.append(f"drop-role: {effects.drop_role}")
        if effects.record_cluster_id:
            self.store = StoreFacts(self.store.epoch, effects.record_cluster_id)
            out.append(f"record-cluster-id {effects.record_cluster_id}")
        persist = effects.persist_role
        if persist is not None:
            self.store = StoreFacts(persist.epoch, self.store.cluster_id)
            out.append(f"persist-role {persist.role.name.lower()} epoch={persist.epoch}")
        take = effects.take_master
        if take is not None:
            out.append(
                f"take-master epoch={take.epoch} members={','.join(take.members)} "
                f"sync={take.sync_source_id or '-'} attempt={take.attempt} reason={take.reason}"
            )
        follow = effects.follow
        if follow is not None:
            out.append(f"follow {follow.master_id} epoch={follow.epoch}")
            if self.follow_fails:
                out.append("  (the follower cannot be made: the command is refused)")
            else:
                last = self.core.log.last_lsn
                follower = Follower(
                    FollowerConfig(self.core.config.node_id),
                    cluster_id=self.store.cluster_id,
                    epoch=follow.epoch,
                    master_id=follow.master_id,
                    last_lsn=last,
                    history=((1, 1),) if last else (),
                )
                followed = self.core.followed(
                    follow.epoch, follow.master_id, follow.lease_ms, self.now_ms, follower
                )
                out.extend(f"  {line}" for line in self.effects(followed))
        if effects.join_taking:
            out.append("join-taking")
        if effects.members is not None:
            out.append(f"members {','.join(effects.members)}")
        for fault in effects.faults:
            out.append(f"fault: {fault}")
        if effects.compact_from:
            out.append(f"compact-from {effects.compact_from}")
        if effects.record_commit:
            out.append(f"record-commit {effects.record_commit}")
        if effects.advance_commit is not None:
            out.append(f"advance-commit {effects.advance_commit}")
        for ack in effects.acks:
            out.append(
                f"ack received={ack.received_lsn} written={ack.written_lsn} synced={ack.synced_lsn}"
            )
        return out

    def state(self) -> str:
        """The core's state as one line."""
        c = self.core
        role = c.role.name.lower()
        text = f"state: {role} epoch={c.epoch} floor={c.epoch_floor} seq={c.command_seq}"
        if c.master_id:
            text += f" master={c.master_id}"
        if c.lease_until_ms:
            text += f" lease-until={c.lease_until_ms}"
        if c.taking is not None:
            t = c.taking
            text += f" taking={t.epoch}/{t.source_id or '-'}"
            if t.finished:
                text += "(failed)" if t.error is not None else "(done)"
        if c.joined:
            text += " joined"
        if c.frozen_for:
            text += f" frozen={c.frozen_for}@{c.frozen_until_ms}"
        if c.shutdown_finished:
            text += f" finished={c.shutdown_finished}"
        if c.fence.until_ms:
            text += f" fence={c.fence.target}@{c.fence.until_ms}"
        if c.deposed:
            text += f" deposed={c.deposed!r}"
        if c.failed_reason:
            text += f" failed={c.failed_reason!r}"
        if c.log != LogPosition():
            text += f" log={c.log.log_start_lsn}..{c.log.last_lsn} recorded={c.log.commit_recorded}"
            if c.log.commit_recording:
                text += f" recording={c.log.commit_recording}"
        return text


@dataclass(frozen=True)
class _Entry:
    """A log entry as the follower reads it."""

    lsn: int
    epoch: int
    operation: bytes
    checksum: int


def _entry(lsn: int, epoch: int, *, bad: bool = False) -> _Entry:
    operation = f"op {lsn}".encode()
    return _Entry(lsn, epoch, operation, zlib.crc32(operation) ^ (1 if bad else 0))


def refused(refusal: RoleRefusal) -> str:
    """A refusal as one line, with its metadata."""
    meta = "".join(f" [{k}={v}]" for k, v in refusal.metadata)
    return f"refused {refusal.code.value}: {refusal.message}{meta}"


def options_of(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split ``a b k=v`` into positionals and options."""
    return [w for w in words if "=" not in w], dict(w.split("=", 1) for w in words if "=" in w)


def execute(h: Harness | None, line: str) -> tuple[Harness | None, list[str]]:
    """Run one transcript command; return the (possibly new) harness and its output."""
    words = shlex.split(line)
    command, (positional, options) = words[0], options_of(words[1:])
    if command == "replica":
        nodes = options["nodes"].split(",")
        log = LogPosition(
            int(options.get("last", "0")),
            int(options.get("start", "1")),
            int(options.get("recorded", "0")),
        )
        h = Harness(
            positional[0],
            nodes,
            int(options.get("epoch", "0")),
            options.get("cluster", ""),
            log,
            int(options.get("retention", "0")),
        )
        return h, [h.state()]
    if h is None:
        raise ValueError(f"{command}: no replica yet")
    core = h.core
    out: list[str] = []
    if command == "role":
        word = positional[0]
        role = int(ROLE_WORDS[word]) if word in ROLE_WORDS else int(word)
        h.follow_fails = options.get("follow") == "fails"
        order = RoleOrder(
            role=role,
            epoch=int(options.get("epoch", "0")),
            master_id=options.get("master", ""),
            members=tuple(m for m in options.get("members", "").split(",") if m),
            sync_source_id=options.get("sync", ""),
            reason=options.get("reason", ""),
            seq=int(options.get("seq", "0")),
            lease_ms=int(options.get("lease", "0")),
            cluster_id=options.get("cluster", ""),
        )
        out += h.effects(core.role_command(order, h.now_ms, h.store))
    elif command == "taken":
        out += h.effects(core.master_taken(int(positional[0])))
    elif command == "finished":
        error = None
        if "error" in options:
            code, _, message = options["error"].partition(":")
            error = RoleRefusal(Code(code), message)
        out += h.effects(core.taking_finished(int(positional[0]), error, h.now_ms))
    elif command == "answer":
        out += h.effects(core.taking_answer(int(positional[0])))
    elif command == "tick":
        h.now_ms += int(options["ms"])
        out.append(f"t={h.now_ms}")
        out += h.effects(core.tick(h.now_ms))
    elif command == "deposed":
        out += h.effects(core.deposed_by(options["reason"]))
    elif command == "failstop":
        out += h.effects(core.fail_stop(options["reason"]))
    elif command == "drop":
        out += h.effects(core.drop_role(options["reason"]))
    elif command == "freeze":
        out += h.effects(core.freeze(positional[0], h.now_ms, int(options.get("hold", "120000"))))
    elif command == "finish":
        out += h.effects(core.finish(positional[0]))
    elif command == "abort":
        out += h.effects(core.abort(positional[0]))
    elif command == "fence":
        until_ms = h.now_ms + int(options["ms"])
        refusal = core.fence_writes(options["target"], int(options["epoch"]), until_ms)
        out.append(refused(refusal) if refusal is not None else f"fenced until {until_ms}")
    elif command == "unfence":
        core.lift_fence(int(options["epoch"]))
    elif command == "write":
        refusal = core.write_refusal(h.now_ms, lambda: "fetching log from sync source (twin)")
        out.append("write accepted" if refusal is None else refused(refusal))
    elif command == "written":
        last = int(options["last"])
        synced = "synced" in positional
        ack = Ack(last, last, last if synced else 0)
        follower = core.follower
        if follower is not None and follower.state().written_lsn < last <= follower.last_lsn:
            ack = follower.on_written(last, synced=synced)  # it accepted them: its ack
        out += h.effects(
            core.slave_written(
                last_lsn=last,
                batch_commit_lsn=int(options["batch-commit"]),
                commit_lsn=int(options["commit"]),
                ack=ack,
            )
        )
    elif command == "batch":
        bad = int(options.get("bad", "0"))
        entries = [
            _entry(int(lsn), int(epoch), bad=int(lsn) == bad)
            for lsn, epoch in (e.split(":") for e in options.get("entries", "").split(",") if e)
        ]
        truncate = int(options["truncate"]) if "truncate" in options else None
        out += h.effects(
            core.slave_batch(
                int(options["stream"]),
                epoch=int(options["epoch"]),
                entries=entries,
                commit_lsn=int(options.get("commit", "0")),
                truncate_after_lsn=truncate,
            )
        )
    elif command == "snapshot":
        history = [
            (int(e), int(lsn))
            for e, lsn in (b.split(":") for b in options.get("history", "").split(",") if b)
        ]
        out += h.effects(
            core.slave_snapshot_chunk(
                int(options["stream"]),
                index=int(options["index"]),
                snapshot_lsn=int(options["lsn"]),
                snapshot_epoch=int(options["epoch"]),
                last="last" in positional,
                history=history,
            )
        )
    elif command == "heartbeat" and "stream" in options:
        out += h.effects(
            core.slave_heartbeat_message(
                int(options["stream"]),
                epoch=int(options["epoch"]),
                commit_lsn=int(options["commit"]),
            )
        )
    elif command == "heartbeat":
        last = int(options.get("ack", str(core.log.last_lsn)))
        out += h.effects(
            core.slave_heartbeat(commit_lsn=int(options["commit"]), ack=Ack(last, last, 0))
        )
    elif command == "recorded":
        out += h.effects(core.commit_record_done(int(positional[0])))
    elif command == "record-failed":
        out += h.effects(core.commit_record_failed())
    elif command == "appended":
        out += h.effects(core.log_appended(int(options["last"]), int(options.get("recorded", "0"))))
    elif command == "truncated":
        out += h.effects(core.log_truncated(int(options["keep"]), int(options["start"])))
    elif command == "compacted":
        out += h.effects(core.log_compacted(int(options["start"])))
    elif command == "snapshot-installed":
        out += h.effects(core.snapshot_installed(int(options["lsn"]), int(options["commit"])))
    elif command == "hello":
        last = int(options.get("store-last", str(core.log.last_lsn)))
        out += h.effects(
            core.slave_hello(
                master_id=options["master"],
                epoch=int(options["epoch"]),
                cluster_id=options["cluster"],
                store_last_lsn=last,
                store_history=((1, 1),) if last else (),
                store_log_start_lsn=1,
            )
        )
    elif command == "stream":
        current = core.slave_stream(int(positional[0]))
        out.append(refused(current) if isinstance(current, RoleRefusal) else "current")
    elif command == "reset":
        recorded = int(options["recorded"]) if "recorded" in options else None
        out += h.effects(core.log_reset(int(options["last"]), int(options["start"]), recorded))
    else:
        raise ValueError(f"unknown command {command!r}")
    out.append(h.state())
    return h, out


def scenario_files() -> list[Path]:
    """Every replica-role transcript, sorted."""
    return sorted(SCENARIOS.glob("*.txt"))


def test_there_are_replica_scenarios() -> None:
    """The parametrized test below must not pass by finding no files."""
    assert len(scenario_files()) >= 5


@pytest.mark.parametrize("path", scenario_files(), ids=lambda p: p.stem)
def test_replica_scenario(path: Path) -> None:
    """Replays a transcript; SQUALL_REWRITE=1 rewrites it with the actual output."""
    text = path.read_text()
    blocks = parse_transcript(text)
    harness: Harness | None = None
    outputs: list[list[str]] = []
    for block in blocks:
        harness, output = execute(harness, block.command)
        outputs.append(output)
    check_or_rewrite(path, text, render(blocks, outputs))
