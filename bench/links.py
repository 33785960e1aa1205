"""What a topic link costs: forwarding throughput and end-to-end latency (issue 19 item 4).

    python -m bench.links [--events 20000] [--unary 300]

Starts two one-node clusters from deploy/single.toml in a temporary directory (free
loopback ports): site-b, then site-a with site-b in its `[[remotes]]`. On site-a, topic
`src` links to `local` (same cluster) and to `dst` on site-b. Measured in the same run,
so machine load hits every figure alike:

* throughput: `events` 100-byte events published on `src` with `publish_many` (batches of
  500); the publish rate, and for each link the rate at which its destination received
  them (first publish to the last forwarded event seen there), as a ratio of the
  publish rate;
* latency: `unary` events one at a time on `src`, each timed from the publish call to its
  arrival at a following subscriber of `src` itself, of `local` and of `dst` on site-b:
  p50 and p99 per path, and the link paths as a ratio of the direct one.

Every process is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import squall
from deploy import processes
from squall_server.common.config import ClusterConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = b"x" * 100
_WAIT_S = 120.0


@contextmanager
def cluster(run_dir: Path, name: str, remote: str = "") -> Iterator[ClusterConfig]:
    """A running one-node cluster named `name` (linking to a remote gateway address)."""
    path = processes.localize_config(ROOT / "deploy" / "single.toml", run_dir)
    document = tomllib.loads(path.read_text())
    document["cluster"]["name"] = name
    if remote:
        document["remotes"] = [{"name": "site-b", "gateways": [remote]}]
    path.write_text(processes.dump_toml(document))
    config = load_config(path)
    services: list[processes.Service] = []
    try:
        node = config.nodes[0]
        for kind, address in (
            ("replica", node.replica_address),
            ("coordinator", node.coordinator_address),
        ):
            services.append(
                processes.start_service(
                    kind, path, node.id, address, run_dir / "logs" / f"{kind}.log"
                )
            )
        gateway = config.gateways[0]
        services.append(
            processes.start_service(
                "gateway", path, gateway.id, gateway.address, run_dir / "logs" / "gateway.log"
            )
        )
        processes.wait_serving(services, timeout_s=_WAIT_S)
        with squall.connect(gateway.address) as client:
            deadline = time.monotonic() + _WAIT_S
            while not client.status().master_id:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: no master within {_WAIT_S} s")
                time.sleep(0.1)
        yield config
    finally:
        for service in services:
            processes.stop_service(service)


class _Follower(threading.Thread):
    """Follows a topic from its end, noting when each payload arrives."""

    def __init__(self, address: str, topic: str) -> None:
        super().__init__(daemon=True)
        self._client = squall.connect(address)
        self._topic = topic
        self.arrived: dict[bytes, float] = {}
        self.count = 0
        self.last_at = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        with self._client.topic(self._topic).subscribe(None, start="latest") as stream:
            for message in stream:  # ends when the client closes
                now = time.perf_counter()
                self.arrived[message.payload] = now
                self.count += 1
                self.last_at = now
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()
        self._client.close()


def _wait(condition: object, what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {_WAIT_S} s: {what}")
        time.sleep(0.005)


def main(argv: list[str] | None = None) -> int:
    """Runs both measurements and prints them."""
    parser = argparse.ArgumentParser(prog="bench.links", description=__doc__)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--unary", type=int, default=300)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="squall-links-bench-") as tmp:
        with cluster(Path(tmp) / "b", "site-b") as site_b:
            b_address = site_b.gateways[0].address
            with cluster(Path(tmp) / "a", "site-a", remote=b_address) as site_a:
                a_address = site_a.gateways[0].address
                with squall.connect(a_address) as a, squall.connect(b_address) as b:
                    for name in ("src", "local"):
                        a.create_topic(name)
                    b.create_topic("dst")
                    a.topic("src").link("local")
                    a.topic("src").link("dst", cluster="site-b")
                    followers = {
                        "direct": _Follower(a_address, "src"),
                        "local link": _Follower(a_address, "local"),
                        "remote link": _Follower(b_address, "dst"),
                    }
                    for follower in followers.values():
                        follower.start()
                    time.sleep(1.0)  # the followers' streams are open
                    publisher = a.topic("src").publisher()
                    started = time.perf_counter()
                    publisher.publish_many([PAYLOAD] * args.events, batch_events=500)
                    published_s = time.perf_counter() - started
                    for follower in followers.values():
                        _wait(lambda f=follower: f.count >= args.events, "forwarding")
                    rates = {
                        path: args.events / (f.last_at - started) for path, f in followers.items()
                    }
                    publish_rate = args.events / published_s
                    latencies: dict[str, list[float]] = {path: [] for path in followers}
                    for i in range(args.unary):
                        payload = b"u%d" % i
                        sent = time.perf_counter()
                        publisher.publish(payload)
                        for path, follower in followers.items():
                            _wait(lambda f=follower, p=payload: p in f.arrived, "arrival")
                            latencies[path].append((follower.arrived[payload] - sent) * 1000)
                    publisher.close()
                    for follower in followers.values():
                        follower.close()
    print(f"publish_many into src: {publish_rate:8.0f} events/s ({args.events} events)")
    for path, rate in rates.items():
        print(f"  received via {path:<12} {rate:8.0f} events/s  ({rate / publish_rate:.2f}x)")
    direct_p50 = statistics.median(latencies["direct"])
    for path, values in latencies.items():
        values.sort()
        p50, p99 = statistics.median(values), values[max(0, int(len(values) * 0.99) - 1)]
        print(
            f"publish -> subscriber via {path:<12} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  "
            f"({p50 / direct_p50:.2f}x direct p50)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
