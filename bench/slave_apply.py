"""A slave's CPU per replication batch (issue 16), measured in process.

A lone publish reaches each slave as a replication batch of one log entry; the slave
checks it, appends it to its store (one LMDB transaction) and acknowledges it. This
drives the shipped slave side (``replication_server.serve_replicate`` over a
``ReplicaNode`` in the slave role, its store LMDB in a temporary directory, no gRPC:
what is measured is the slave's own work, not the network's) with the batches a master
sends: a Hello, then one ``EntryBatch`` per entry, each sent once the previous one's
written ack came back (one publish at a time). The entries are the log of a one-node
master (in-memory store) that took ``--batches`` lone publishes of one 100-byte event,
from 8 publishers in turn, each with its next sequence, as the gateway sends them.

Reports process CPU time per batch (``time.process_time``: the loop and the store
thread; not wall-clock, the machine is shared); with ``--floor``, the CPU of the same
transactions in py-lmdb alone (the gets and puts the store makes for each entry,
recorded from the in-memory twin: the floor of the store write); with ``--store``
the CPU of ``Store.append`` alone for the same entries (what master and slaves share).
``--profile`` runs cProfile over the measured batches and prints the top functions.

``python -m bench.slave_apply [--batches N] [--replica-sync P] [--repeat N] [--floor]
[--store] [--profile]``. A measurement, not a test; every loop is bounded by a count.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from bench.master_parts import CLUSTER_ID, bench_config, role_command
from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.clock import SystemClock
from squall_server.replica import commands
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.replication_server import serve_replicate
from squall_server.replica.store import DATABASES, Store
from squall_server.replica.store.stall import StallMeter

EVENT_BYTES = 100
WARMUP_BATCHES = 300
TOPIC = "bench"
PUBLISHERS = 8
MAP_SIZE_BYTES = 1 << 30
WAIT_S = 60.0


async def _master_log(directory: Path, publishes: int) -> list[replica_pb2.LogEntry]:
    """The log of a one-node master (in-memory store) after `publishes` lone publishes."""
    config = bench_config(directory, ("m1",))
    store = Store.open_memory()
    master = build_replica_node(config, config.node("m1"), store)
    await master.start()
    try:
        await master.apply_role(role_command(common_pb2.ROLE_MASTER, ("m1",)))
        for _ in range(1000):  # bounded: the role is taken within a few loop turns
            if master.role == common_pb2.ROLE_MASTER:
                break
            await asyncio.sleep(0.01)
        await asyncio.wait_for(
            master.write(commands.CreateTopic(TOPIC, common_pb2.TOPIC_KIND_REPLICATED)), WAIT_S
        )
        payload = b"x" * EVENT_BYTES
        for n in range(publishes):
            k = n % PUBLISHERS
            request = broker_pb2.PublishRequest(
                topic=TOPIC, publisher_id=f"p{k}", session_token=f"p{k}/s1"
            )
            request.events.add(payload=payload, sequence=n // PUBLISHERS + 1)
            await asyncio.wait_for(master.write(commands.Publish(request)), WAIT_S)
        return store.read_log(1, publishes + 100)
    finally:
        await master.stop()


async def _slave_run(
    directory: Path, entries: list[replica_pb2.LogEntry], args: argparse.Namespace
) -> tuple[int, float, cProfile.Profile | None]:
    """Feeds entries to a slave one batch at a time; returns (batches measured, CPU s,
    profile)."""
    node_ids = ("m1", "s1")
    config = bench_config(directory, node_ids, replica_sync=args.replica_sync)
    store = Store.open_lmdb(config.node("s1").data_dir / "store", MAP_SIZE_BYTES)
    slave = build_replica_node(config, config.node("s1"), store)
    await slave.start()
    measured_from = len(entries) - args.batches
    acked: asyncio.Queue[int] = asyncio.Queue()
    profile = cProfile.Profile() if args.profile else None
    started: list[float] = []

    async def requests() -> AsyncIterator[replica_pb2.ReplicateRequest]:
        yield replica_pb2.ReplicateRequest(
            hello=replica_pb2.ReplicationHello(master_id="m1", epoch=1, cluster_id=CLUSTER_ID)
        )
        await acked.get()  # the position
        for index, entry in enumerate(entries):
            if index == measured_from:
                started.append(time.process_time())
                if profile is not None:
                    profile.enable()
            request = replica_pb2.ReplicateRequest()
            batch = request.entries
            batch.entries.append(entry)
            batch.commit_lsn = entry.lsn - 1
            batch.epoch = 1
            yield request
            while await acked.get() < entry.lsn:  # bounded: each batch is acked once
                pass

    try:
        await slave.apply_role(role_command(common_pb2.ROLE_SLAVE, node_ids))
        want = replica_pb2.ReplicationAck.__name__
        async for response in serve_replicate(slave, requests()):
            if response.HasField("position"):
                acked.put_nowait(0)
                continue
            ack = response.ack
            done = ack.synced_lsn if args.replica_sync == "SYNC" else ack.written_lsn
            if args.replica_sync == "NO_SYNC":
                done = ack.received_lsn
            if not response.HasField("ack"):
                raise RuntimeError(f"expected a {want}, got {response}")
            acked.put_nowait(done)
            if done >= entries[-1].lsn:
                break
        cpu_s = time.process_time() - started[0]
        if profile is not None:
            profile.disable()
    finally:
        await slave.stop()
        store.close()
    return args.batches, cpu_s, profile


def _store_alone(directory: Path, entries: list[replica_pb2.LogEntry], batches: int) -> float:
    """CPU µs per one-entry ``Store.append`` on LMDB alone (no replica around it, a stall
    meter as the replica installs): the part of the write master and slaves share."""
    store = Store.open_lmdb(directory, MAP_SIZE_BYTES)
    store.stall_meter = StallMeter(SystemClock())
    measured_from = len(entries) - batches
    cpu0 = 0.0
    try:
        for index, entry in enumerate(entries):
            if index == measured_from:
                cpu0 = time.process_time()
            store.append([entry], sync=False, commit_lsn=entry.lsn - 1)
        cpu_s = time.process_time() - cpu0
    finally:
        store.close()
    return cpu_s * 1e6 / batches


class _Recorder:
    """A write transaction that records the KV calls the store makes through it."""

    def __init__(self, txn: Any, calls: list[tuple[str, str, bytes, bytes]]) -> None:
        self._txn = txn
        self._calls = calls

    def get(self, db: str, key: bytes) -> bytes | None:
        self._calls.append(("get", db, key, b""))
        value: bytes | None = self._txn.get(db, key)
        return value

    def put(self, db: str, key: bytes, value: bytes) -> None:
        self._calls.append(("put", db, key, value))
        self._txn.put(db, key, value)

    def put_many(self, db: str, items: Any, *, append: bool = False) -> None:
        items = list(items)
        for key, value in items:
            self._calls.append(("append" if append else "put", db, key, value))
        self._txn.put_many(db, items, append=append)

    def generation(self) -> int:
        value: int = self._txn.generation()
        return value

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the floor does not replay {name}: a lone publish makes none")


def _floor(directory: Path, entries: list[replica_pb2.LogEntry], batches: int) -> float:
    """CPU µs per transaction of py-lmdb alone making the KV calls the store makes for
    each entry (recorded from an in-memory store applying them): its floor."""
    store = Store.open_memory()
    kv = store._kv  # a measurement: the calls the store makes
    write = kv.write
    per_entry: list[list[tuple[str, str, bytes, bytes]]] = []

    @contextmanager
    def recording(*, sync: bool) -> Iterator[Any]:
        with write(sync=sync) as txn:
            yield _Recorder(txn, per_entry[-1])

    kv.write = recording  # type: ignore[method-assign]
    for entry in entries:
        per_entry.append([])
        store.append([entry], sync=False, commit_lsn=entry.lsn - 1)
    env = lmdb.open(
        str(directory),
        max_dbs=len(DATABASES),
        map_size=MAP_SIZE_BYTES,
        sync=False,
        metasync=False,
        writemap=False,
    )
    dbs = {name: env.open_db(name.encode()) for name in DATABASES}
    measured_from = len(per_entry) - batches
    cpu0 = 0.0
    for index, calls in enumerate(per_entry):
        if index == measured_from:
            cpu0 = time.process_time()
        with env.begin(write=True) as txn:
            for op, name, key, value in calls:
                if op == "get":
                    txn.get(key, db=dbs[name])
                else:
                    txn.put(key, value, db=dbs[name], append=op == "append")
    cpu_s = time.process_time() - cpu0
    env.close()
    last = per_entry[-1]
    gets = sum(1 for call in last if call[0] == "get")
    print(f"KV calls of the last entry's append: {gets} gets, {len(last) - gets} puts")
    return cpu_s * 1e6 / batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slave_apply", description=__doc__)
    parser.add_argument("--batches", type=int, default=3000, help="batches measured")
    parser.add_argument(
        "--replica-sync", default="WRITE_NO_SYNC", choices=("WRITE_NO_SYNC", "SYNC", "NO_SYNC")
    )
    parser.add_argument("--repeat", type=int, default=1, help="measured runs, each a fresh slave")
    parser.add_argument("--floor", action="store_true", help="also py-lmdb alone")
    parser.add_argument("--store", action="store_true", help="also Store.append alone")
    parser.add_argument("--profile", action="store_true", help="cProfile the measured batches")
    parser.add_argument("--top", type=int, default=30, help="functions the profile prints")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="squall-bench-slave-") as tmp:
        entries = asyncio.run(_master_log(Path(tmp) / "master", args.batches + WARMUP_BATCHES))
        for run in range(args.repeat):
            directory = Path(tmp) / f"slave-{run}"
            directory.mkdir()
            batches, cpu_s, profile = asyncio.run(_slave_run(directory, entries, args))
            print(
                f"replica_sync={args.replica_sync} batches={batches} "
                f"cpu_us/batch={cpu_s * 1e6 / batches:.1f}",
                flush=True,
            )
            if profile is not None:
                out = io.StringIO()
                stats = pstats.Stats(profile, stream=out)
                stats.sort_stats("tottime").print_stats(args.top)
                stats.sort_stats("cumulative").print_stats(args.top)
                print(out.getvalue())
        if args.store:
            for run in range(args.repeat):
                directory = Path(tmp) / f"store-{run}"
                us = _store_alone(directory, entries, args.batches)
                print(f"Store.append alone, one entry: cpu_us/append={us:.1f}", flush=True)
        if args.floor:
            directory = Path(tmp) / "floor"
            directory.mkdir()
            floor_us = _floor(directory, entries, args.batches)
            print(f"py-lmdb alone, the same records: cpu_us/txn={floor_us:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
