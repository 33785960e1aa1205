"""Store size per event and live-backup speed, for sizing a node's disk (docs/deployment.md).

One node from deploy/single.toml runs as real processes on loopback (data in a temporary
directory). For each payload size the bench publishes events through the gateway with
the client library, then reads the store's file size (LMDB without writemap grows the
file with the pages it uses) and divides by the events: the log entry and the event
record together, with their keys, checksums and B-tree overhead. Then it takes
`squall store backup` of the live store while a publisher keeps writing, and reports its
time, the copy's size and its rate. Sizes hold on any machine; times depend on the disk
and on what else runs.

    .venv/bin/python -m bench.store_size [--events N] [--payload-bytes B ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import squall
from deploy import processes
from deploy.launcher import wait_for_master
from squall_server.common.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _start(run_dir: Path) -> tuple[list[processes.Service], str, Path]:
    config_path = processes.localize_config(ROOT / "deploy" / "single.toml", run_dir)
    config = load_config(config_path)
    node, gateway = config.nodes[0], config.gateways[0]
    services = [
        processes.start_service(
            kind, config_path, name, address, run_dir / "logs" / f"{kind}-{name}.log"
        )
        for kind, name, address in (
            ("replica", node.id, node.replica_address),
            ("coordinator", node.id, node.coordinator_address),
            ("gateway", gateway.id, gateway.address),
        )
    ]
    return services, gateway.address, node.data_dir


def measure(events: int, payload_bytes: int) -> dict[str, object]:
    """Publishes events of payload_bytes into a fresh node; sizes it and backs it up live."""
    with tempfile.TemporaryDirectory(prefix="squall-store-size-") as tmp:
        run_dir = Path(tmp)
        services, gateway, data_dir = _start(run_dir)
        try:
            processes.wait_serving(services)
            wait_for_master(gateway)
            with squall.connect(gateway) as client:
                client.create_topic("sizing")
                topic = client.topic("sizing")
                payload = b"x" * payload_bytes
                with topic.publisher("sizer") as publisher:
                    for start in range(0, events, 20_000):
                        publisher.publish_many(
                            [payload] * min(20_000, events - start), batch_events=500
                        )
                store_bytes = (data_dir / "data.mdb").stat().st_size

                # A backup while another publisher keeps writing, as in production.
                stop = threading.Event()

                def keep_publishing() -> None:
                    with topic.publisher("during-backup") as during:
                        for _ in range(100_000):  # bounded; stopped after the backup
                            if stop.is_set():
                                return
                            during.publish_many([payload] * 500, batch_events=500)

                writer = threading.Thread(target=keep_publishing, daemon=True)
                writer.start()
                dest = run_dir / "backup"
                started = time.monotonic()
                result = subprocess.run(
                    [
                        *(sys.executable, "-m", "squall_server"),
                        *("store", "backup", str(data_dir), str(dest)),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                )
                backup_s = time.monotonic() - started
                stop.set()
                writer.join(timeout=60)
                if result.returncode != 0:
                    raise RuntimeError(f"backup failed: {result.stderr}")
                manifest = json.loads((dest / "squall-backup.json").read_text())
        finally:
            for service in services:
                processes.stop_service(service)
    return {
        "events": events,
        "payload_bytes": payload_bytes,
        "store_bytes": store_bytes,
        "store_bytes_per_event": round(store_bytes / events, 1),
        "backup_s": round(backup_s, 2),
        "backup_bytes": manifest["data_bytes"],
        "backup_mb_per_s": round(manifest["data_bytes"] / backup_s / 1e6, 1),
        "backup_last_lsn": manifest["last_lsn"],
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the measurement for each payload size; prints one JSON object per line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--payload-bytes", type=int, action="append")
    args = parser.parse_args(argv)
    for payload_bytes in args.payload_bytes or [100, 1000]:
        print(json.dumps(measure(args.events, payload_bytes)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
