"""The master's CPU per part of a joined publish request (issue 16), measured in process.

A client's publishers share one publish stream and concurrent lone publishes join into
one request (``PublishRequest.parts``); the master begins every part. This drives the
shipped ``Publisher.PublishStream`` servicer directly (no gRPC: what is measured is the
master's own work per part, not the network's) with joined requests of ``--parts`` parts,
each part a publisher of its own with its next sequence and one 100-byte event, a few
requests in flight as the client's stream keeps them, and reports process CPU time per
part (``time.process_time``: the loop and the store thread; not wall-clock, the machine
is shared), and that less what the nodes burn idle (sampled for a second before, per
second of the run: a loaded machine stretches the run and with it the ticks' share).

* ``--nodes 1`` (default): one ``ReplicaNode`` over an LMDB store in a temporary
  directory, master of a one-node group (a write commits once the master holds it):
  the master's path without replication.
* ``--nodes 3``: three ``ReplicaNode``s over the simulated replica transport
  (``tests/sim/replica_transport.py``, in-memory stores), acks majority: the figure then
  includes both slaves' work too (the profile tells them apart).

``--lone``: the one-at-a-time shape instead (issue 16's lone publish): every request is
one event of one publisher with its next sequence (no ``parts``), one request in flight,
so every commit batch holds one entry; the figure is CPU per publish.

``--profile`` runs cProfile over the measured rounds and prints the top functions.
``python -m bench.master_parts [--nodes 1|3] [--parts N | --lone] [--requests N] [--profile]``.
A measurement, not a test; every loop is bounded by a count.
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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deploy.processes import free_ports
from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig, parse_config
from squall_server.replica import commands, server
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import Store

EVENT_BYTES = 100
# Requests a client's shared stream keeps in flight (the mux sends as callers come).
WINDOW = 4
WARMUP_REQUESTS = 200
TOPIC = "bench"
CLUSTER_ID = "c-bench-parts"
WAIT_S = 60.0
# Seconds the idle CPU is sampled for, just before the measured run.
IDLE_S = 1.0


def bench_config(
    directory: Path,
    node_ids: tuple[str, ...],
    *,
    master_sync: str = "WRITE_NO_SYNC",
    replica_sync: str | None = None,
) -> ClusterConfig:
    """A cluster of node_ids in directory for an in-process harness (this one's and
    bench/slave_apply.py's); replica_sync None keeps the default."""
    ports = iter(free_ports(2 * len(node_ids) + 1))
    text = '[cluster]\nname = "bench"\n'
    for priority, node_id in enumerate(node_ids, 1):
        text += (
            f'\n[[nodes]]\nid = "{node_id}"\npriority = {priority}\n'
            f'coordinator_address = "127.0.0.1:{next(ports)}"\n'
            f'replica_address = "127.0.0.1:{next(ports)}"\ndata_dir = "{node_id}"\n'
        )
    text += f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{next(ports)}"\n'
    text += f'\n[durability]\nmaster_sync = "{master_sync}"\nacks = "majority"\n'
    if replica_sync is not None:
        text += f'replica_sync = "{replica_sync}"\n'
    config = parse_config(text, directory / "cluster.toml")
    for node_id in node_ids:
        config.node(node_id).data_dir.mkdir(parents=True, exist_ok=True)
    return config


def _endpoint(node_id: str) -> common_pb2.NodeEndpoint:
    return common_pb2.NodeEndpoint(node_id=node_id)


def role_command(role: int, node_ids: tuple[str, ...]) -> replica_pb2.RoleCommand:
    """Epoch 1's role for one of node_ids, the first of them master (a long lease)."""
    return replica_pb2.RoleCommand(
        seq=1,
        epoch=1,
        role=role,  # type: ignore[arg-type]
        master=_endpoint(node_ids[0]),
        members=[_endpoint(n) for n in node_ids] if role == common_pb2.ROLE_MASTER else [],
        sync_source_id=node_ids[0] if role == common_pb2.ROLE_MASTER else "",
        lease_ms=600_000,
        cluster_id=CLUSTER_ID,
    )


class _Context:
    """What PublishStream reads of a call's context: no metadata, no deadline."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"the stream was aborted: {code} {details}")


class _Parts:
    """Joined requests: part k is publisher p{k}, each publisher's sequence counting up."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self.sequence = 0
        self.payload = b"x" * EVENT_BYTES

    def next(self) -> broker_pb2.PublishRequest:
        self.sequence += 1
        if self.parts == 0:
            # A lone publish as a client's stream sends it: one publisher, one event.
            request = broker_pb2.PublishRequest(
                topic=TOPIC,
                publisher_id="p0",
                session_token="p0/s1",
                compact_receipts=True,
                request_id=self.sequence,
            )
            request.events.add(payload=self.payload, sequence=self.sequence)
            return request
        request = broker_pb2.PublishRequest(topic=TOPIC, request_id=self.sequence)
        for k in range(self.parts):
            part = request.parts.add(
                topic=TOPIC,
                publisher_id=f"p{k}",
                session_token=f"p{k}/s1",
                compact_receipts=True,
                request_id=k + 1,
            )
            part.events.add(payload=self.payload, sequence=self.sequence)
        return request


async def _stream(master: ReplicaNode, maker: _Parts, requests: int) -> int:
    """Sends `requests` requests on one PublishStream, WINDOW in flight (one when lone);
    returns the parts (lone: publishes) answered ok (every one must be)."""
    window = asyncio.Semaphore(1 if maker.parts == 0 else WINDOW)

    async def incoming() -> AsyncIterator[broker_pb2.PublishRequest]:
        for _ in range(requests):
            await window.acquire()
            yield maker.next()

    ok = 0
    servicer = server.Publisher(master)
    async for response in servicer.PublishStream(incoming(), _Context()):  # type: ignore[arg-type]
        window.release()
        if maker.parts == 0:
            if response.HasField("error"):
                raise RuntimeError(f"a publish failed: {response.error}")
            ok += 1
            continue
        for part in response.parts:
            if part.HasField("error"):
                raise RuntimeError(f"a part failed: {part.error}")
            ok += 1
    return ok


async def _run(args: argparse.Namespace) -> dict[str, float]:
    node_ids = ("n1",) if args.nodes == 1 else ("n1", "n2", "n3")
    with tempfile.TemporaryDirectory(prefix="squall-bench-parts-") as tmp:
        config = bench_config(Path(tmp), node_ids, master_sync=args.master_sync)
        network: Any = None
        if args.nodes == 1:
            stores = {"n1": Store.open_lmdb(config.node("n1").data_dir / "store", 1 << 30)}
            nodes = {"n1": build_replica_node(config, config.node("n1"), stores["n1"])}
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.sim.replica_transport import SimReplicaNetwork

            network = SimReplicaNetwork()
            nodes = await network.start_replicas(config, node_ids)
        if network is None:
            await nodes["n1"].start()
        master = nodes["n1"]
        try:
            for node_id in node_ids[1:]:
                await nodes[node_id].apply_role(role_command(common_pb2.ROLE_SLAVE, node_ids))
            await master.apply_role(role_command(common_pb2.ROLE_MASTER, node_ids))
            for _ in range(1000):  # bounded: the role is taken within a few loop turns
                if master.role == common_pb2.ROLE_MASTER:
                    break
                await asyncio.sleep(0.01)
            await asyncio.wait_for(
                master.write(commands.CreateTopic(TOPIC, common_pb2.TOPIC_KIND_REPLICATED)),
                WAIT_S,
            )
            maker = _Parts(args.parts)
            await _stream(master, maker, WARMUP_REQUESTS)
            # What the nodes burn idle (ticks, heartbeats): subtracted per second of the
            # measured run, which a loaded machine stretches.
            idle0, idle_wall0 = time.process_time(), time.perf_counter()
            await asyncio.sleep(IDLE_S)
            idle_per_s = (time.process_time() - idle0) / (time.perf_counter() - idle_wall0)
            profile = cProfile.Profile() if args.profile else None
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if profile is not None:
                profile.enable()
            ok = await _stream(master, maker, args.requests)
            if profile is not None:
                profile.disable()
            cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        finally:
            for node in nodes.values():
                await node.stop()
    if profile is not None:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())
    return {
        "parts_per_request": args.parts,
        "parts": ok,
        "cpu_us_per_part": cpu_s * 1e6 / ok,
        "above_idle_us_per_part": (cpu_s - idle_per_s * wall_s) * 1e6 / ok,
        "wall_s": wall_s,
        "parts_per_cpu_s": ok / cpu_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.master_parts", description=__doc__)
    parser.add_argument("--nodes", type=int, choices=(1, 3), default=1)
    parser.add_argument("--parts", type=int, default=32, help="parts per joined request")
    parser.add_argument(
        "--lone", action="store_true", help="one event per request, one in flight (not parts)"
    )
    parser.add_argument("--requests", type=int, default=1000, help="joined requests measured")
    parser.add_argument("--master-sync", default="WRITE_NO_SYNC", choices=("WRITE_NO_SYNC", "SYNC"))
    parser.add_argument("--repeat", type=int, default=1, help="measured runs, each a fresh node")
    parser.add_argument("--profile", action="store_true", help="cProfile the measured rounds")
    parser.add_argument("--top", type=int, default=30, help="functions the profile prints")
    args = parser.parse_args(argv)
    if args.lone:
        args.parts = 0
    for _ in range(args.repeat):
        got = asyncio.run(_run(args))
        if args.lone:
            print(
                f"nodes={args.nodes} lone publishes={got['parts']:.0f} "
                f"cpu_us/publish={got['cpu_us_per_part']:.1f} "
                f"above_idle={got['above_idle_us_per_part']:.1f} wall_s={got['wall_s']:.2f}",
                flush=True,
            )
        else:
            print(
                f"nodes={args.nodes} parts/request={args.parts} parts={got['parts']:.0f} "
                f"cpu_us/part={got['cpu_us_per_part']:.1f} "
                f"above_idle={got['above_idle_us_per_part']:.1f} wall_s={got['wall_s']:.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
