"""What TLS costs: the same publishes on a plaintext and a TLS three-node cluster.

    python -m bench.tls_overhead [--rounds 3] [--unary 300] [--pipelined 20000]

Starts deploy/cluster.example.toml twice in a temporary directory (free loopback ports):
once as shipped, once with `[tls] enabled = true` and `squall certs dev` certificates.
Both run at the same time and the rounds alternate between them, so machine load hits
both alike. Each round, through a replicated publisher proxy (the app's client
certificate, straight to the master, which replicates over mutual TLS): `unary` events
one at a time (p50 and p99 latency), then `pipelined` events with `publish_many` in
batches of 500 (events/s). 100-byte events. Every process is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import squall
from deploy import processes
from squall_server.common import dev_certs
from squall_server.common.config import ClusterConfig, load_config
from squall_server.common.tls import cli_transport

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = b"x" * 100


@contextmanager
def cluster(run_dir: Path, tls: bool) -> Iterator[tuple[ClusterConfig, squall.TlsOptions | None]]:
    """A running three-node cluster (and its app TLS options); stopped by PID on exit."""
    path = processes.localize_config(ROOT / "deploy" / "cluster.example.toml", run_dir)
    options = None
    if tls:
        certs = run_dir / "certs"
        dev_certs.make_dev_certs(certs, dev_certs.subjects(load_config(path), ["bench"]))
        document = tomllib.loads(path.read_text())
        document["tls"] = {
            "enabled": True,
            "ca_file": str(certs / "ca.crt"),
            "cert_dir": str(certs),
        }
        path.write_text(processes.dump_toml(document))
        options = squall.TlsOptions(
            ca_file=certs / "ca.crt", cert_file=certs / "bench.crt", key_file=certs / "bench.key"
        )
    config = load_config(path)
    services: list[processes.Service] = []
    try:
        for node in config.nodes:
            for kind, address in (
                ("replica", node.replica_address),
                ("coordinator", node.coordinator_address),
            ):
                services.append(
                    processes.start_service(
                        kind, path, node.id, address, run_dir / "logs" / f"{kind}-{node.id}.log"
                    )
                )
        gateway = config.gateways[0]
        services.append(
            processes.start_service(
                "gateway", path, gateway.id, gateway.address, run_dir / "logs" / "gateway.log"
            )
        )
        processes.wait_serving(services, timeout_s=120, links=cli_transport(config))
        yield config, options
    finally:
        for service in services:
            processes.stop_service(service)


def _ready(config: ClusterConfig, tls: squall.TlsOptions | None) -> None:
    deadline = time.monotonic() + 120
    with squall.connect(config.gateways[0].address, tls=tls) as client:
        while not client.status().master_id:
            if time.monotonic() > deadline:
                raise TimeoutError("no master within 120 s")
            time.sleep(0.1)
        client.create_topic("bench")


def _round(
    config: ClusterConfig, tls: squall.TlsOptions | None, unary: int, pipelined: int
) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, pipelined events/s) of one round."""
    with squall.connect(config.gateways[0].address, tls=tls) as client:
        publisher = client.topic("bench").publisher()
        latencies = []
        for _ in range(unary):
            started = time.perf_counter()
            publisher.publish(PAYLOAD)
            latencies.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        publisher.publish_many([PAYLOAD] * pipelined, batch_events=500)
        rate = pipelined / (time.perf_counter() - started)
        publisher.close()
    latencies.sort()
    return statistics.median(latencies), latencies[int(len(latencies) * 0.99) - 1], rate


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison and prints one line per mode."""
    parser = argparse.ArgumentParser(prog="bench.tls_overhead", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--unary", type=int, default=300)
    parser.add_argument("--pipelined", type=int, default=20000)
    args = parser.parse_args(argv)
    results: dict[str, list[tuple[float, float, float]]] = {"plaintext": [], "tls": []}
    with tempfile.TemporaryDirectory(prefix="squall-tls-bench-") as tmp:
        with (
            cluster(Path(tmp) / "plain", tls=False) as plain,
            cluster(Path(tmp) / "tls", tls=True) as secure,
        ):
            clusters = {"plaintext": plain, "tls": secure}
            for config, tls in clusters.values():
                _ready(config, tls)
            for _ in range(args.rounds):
                for mode, (config, tls) in clusters.items():
                    results[mode].append(_round(config, tls, args.unary, args.pipelined))
    for mode, rounds in results.items():
        p50 = statistics.median(r[0] for r in rounds)
        p99 = statistics.median(r[1] for r in rounds)
        rate = statistics.median(r[2] for r in rounds)
        print(
            f"{mode:<10} unary p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  "
            f"pipelined {rate:8.0f} events/s  (median of {len(rounds)} rounds)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
