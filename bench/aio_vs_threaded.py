"""The asyncio client against the threaded one, in alternating rounds on one cluster.

    python -m bench.aio_vs_threaded                  # 4 rounds, ~30 s on 2 cores
    python -m bench.aio_vs_threaded --rounds 8 --unary-events 1000 --pipelined-events 50000

`make bench` measures `squall.aio` beside `squall` too (each pipelined run right after
the threaded one, one-at-a-time once each); on a shared machine one run of each moves by
2x, so this alternates the four publish scenarios of `bench.single_node` (threaded and
aio, one at a time and pipelined) round after round on one three-node cluster
(deploy/cluster.example.toml, `WRITE_NO_SYNC` / `WRITE_NO_SYNC` / majority, through the
gateway), each run on its own topic, and reports every round and the ratio of medians.
A measurement, not a test. Prints JSON on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import squall
from bench import replicated, single_node

DURABILITY = {"master_sync": "WRITE_NO_SYNC", "replica_sync": "WRITE_NO_SYNC", "acks": "majority"}
DEADLINE_S = 20.0


def main(argv: list[str] | None = None) -> int:
    """Runs the alternating rounds and prints their figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--unary-events", type=int, default=400)
    parser.add_argument("--pipelined-events", type=int, default=20_000)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.unary_events < 1 or args.pipelined_events < 1:
        parser.error("--rounds, --unary-events and --pipelined-events must be >= 1")
    scenarios = {
        "threaded_one_at_a_time": (single_node.unary_publish, args.unary_events),
        "aio_one_at_a_time": (single_node.aio_unary_publish, args.unary_events),
        "threaded_pipelined": (single_node.pipelined_publish, args.pipelined_events),
        "aio_pipelined": (single_node.aio_pipelined_publish, args.pipelined_events),
    }
    rates: dict[str, list[int]] = {name: [] for name in scenarios}
    load_start = list(os.getloadavg())
    with (
        tempfile.TemporaryDirectory(prefix="squall-bench-aio-") as temp,
        replicated.running(Path(temp), durability=dict(DURABILITY)) as cluster,
    ):
        address = cluster.gateway_address
        with squall.connect(address) as client:
            for round_ in range(args.rounds):
                for name in scenarios:
                    client.create_topic(f"{name}-{round_}")
        meter = single_node.CpuMeter(cluster.pids())
        for round_ in range(args.rounds):
            for name, (scenario, count) in scenarios.items():
                figures = scenario(address, f"{name}-{round_}", count, DEADLINE_S, meter)
                rates[name].append(int(figures["events_per_s"]))
            print(
                f"round {round_ + 1}: "
                + ", ".join(f"{name} {values[-1]:,}" for name, values in rates.items()),
                file=sys.stderr,
            )
    medians = {name: statistics.median(values) for name, values in rates.items()}
    result: dict[str, Any] = {
        "durability": DURABILITY,
        "rounds": args.rounds,
        "events": {"one_at_a_time": args.unary_events, "pipelined": args.pipelined_events},
        "events_per_s": rates,
        "median_events_per_s": medians,
        "aio_over_threaded": {
            "one_at_a_time": round(
                medians["aio_one_at_a_time"] / medians["threaded_one_at_a_time"], 2
            ),
            "pipelined": round(medians["aio_pipelined"] / medians["threaded_pipelined"], 2),
        },
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
