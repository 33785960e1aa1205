"""Runs a local Squall cluster: every service its own process on loopback.

    python -m deploy.launcher start --config deploy/single.toml [--demo] [--tls]
    python -m deploy.launcher stop

`start` copies the config into .run/ with free ports (data stays in .run/data, so a
restarted cluster keeps its topics), starts every service as its own process with its own
log (.run/logs/<service>-<id>.log), waits until each answers its health check and a
master is elected, prints the cluster's status table, and records the PIDs in
.run/pids.json. `stop` first shuts the cluster down cleanly (`squall cluster shutdown`:
every store clean at one point, so the next `start` needs no operator), then stops
whatever still runs by PID. With `--tls` (`make run TLS=1`) every link is TLS: development
certificates are made in .run/certs (`squall certs dev`, kept for later runs) and the local
copy of the config gets a `[tls]` section pointing at them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from deploy import processes
from squall_server.common.config import ClusterConfig, ConfigError, load_config, load_config_or_exit
from squall_server.common.tls import cli_transport

if TYPE_CHECKING:
    import squall

RUN_DIR = Path(".run")
PIDS_FILE = RUN_DIR / "pids.json"
# The local copy of the config `start` wrote (processes.localize_config).
LOCAL_CONFIG = RUN_DIR / "cluster.toml"
# The services every node runs, in start order.
NODE_SERVICES = ("replica", "coordinator")


def _running_pids() -> list[dict[str, object]]:
    if not PIDS_FILE.exists():
        return []
    entries: list[dict[str, object]] = json.loads(PIDS_FILE.read_text())
    alive = []
    for entry in entries:
        try:
            os.kill(int(str(entry["pid"])), 0)
            alive.append(entry)
        except ProcessLookupError:
            pass
    return alive


def enable_dev_tls(local_path: Path, certs_dir: Path) -> None:
    """Turns TLS on in the local config, with development certificates in certs_dir."""
    import tomllib

    from squall_server.common import dev_certs

    config = load_config_or_exit(local_path)
    wanted = dev_certs.subjects(config, [])
    if not all((certs_dir / f"{s.identity}.crt").exists() for s in wanted):
        dev_certs.make_dev_certs(certs_dir, wanted, force=True)
        print(f"made development certificates in {certs_dir} (squall certs dev)")
    document = tomllib.loads(local_path.read_text())
    document["tls"] = {
        "enabled": True,
        "ca_file": str((certs_dir / "ca.crt").resolve()),
        "cert_dir": str(certs_dir.resolve()),
    }
    local_path.write_text(processes.dump_toml(document))


def _app_tls(config: ClusterConfig) -> squall.TlsOptions | None:
    """How the launcher's own calls (health, status, demo) connect: as admin over TLS."""
    import squall

    tls = config.tls
    if not tls.enabled or tls.ca_file is None or tls.cert_dir is None:
        return None
    return squall.TlsOptions(
        ca_file=tls.ca_file,
        cert_file=tls.cert_dir / "admin.crt",
        key_file=tls.cert_dir / "admin.key",
        server_name=config.gateways[0].id,
    )


def start(config_path: Path, demo: bool, tls: bool = False, free_ports: bool = False) -> int:
    """Starts the cluster described by config_path; returns an exit status."""
    if _running_pids():
        print(
            "squall: a local cluster is already running (see .run/pids.json); "
            "run `make stop` first",
            file=sys.stderr,
        )
        return 1
    load_config_or_exit(config_path)  # a broken file stops here with one clear line
    # The gateway keeps its configured port (the CLI's default) unless told or taken.
    local_path = processes.localize_config(config_path, RUN_DIR, keep_gateway=not free_ports)
    if tls:
        enable_dev_tls(local_path, RUN_DIR / "certs")
    config = load_config_or_exit(local_path)
    app_tls = _app_tls(config)
    services: list[processes.Service] = []
    logs = RUN_DIR / "logs"
    for node in config.nodes:
        for kind in NODE_SERVICES:
            address = node.replica_address if kind == "replica" else node.coordinator_address
            services.append(
                processes.start_service(
                    kind, local_path, node.id, address, logs / f"{kind}-{node.id}.log"
                )
            )
    for gateway in config.gateways:
        services.append(
            processes.start_service(
                "gateway",
                local_path,
                gateway.id,
                gateway.address,
                logs / f"gateway-{gateway.id}.log",
            )
        )
    PIDS_FILE.write_text(
        json.dumps(
            [
                {"kind": s.kind, "name": s.name, "pid": s.pid, "address": s.address}
                for s in services
            ],
            indent=2,
        )
    )
    try:
        processes.wait_serving(services, links=cli_transport(config))
    except (RuntimeError, TimeoutError) as exc:
        print(f"squall: the cluster did not start: {exc}", file=sys.stderr)
        stop()
        return 1
    print(f"Squall is running from {config_path} (local copy: {local_path}):")
    for s in services:
        print(f"  {s.kind:<12} {s.name:<6} {s.address:<22} pid {s.pid}  log {s.log_path}")
    gateway_address = config.gateways[0].address
    try:
        master = wait_for_master(gateway_address, tls=app_tls)
    except TimeoutError as exc:
        # The table says why (e.g. stores that refuse a cold start after a crash).
        print_status(gateway_address, local_path)
        print(
            f"squall: {exc}; the reasons are in the table above and the logs in {logs} "
            "(docs/operations.md); `make stop` stops the processes",
            file=sys.stderr,
        )
        return 1
    print(f"  master elected: {master}\n")
    print_status(gateway_address, local_path)
    if demo:
        _demo(config, gateway_address, app_tls)
    # --config brings the [tls] settings (and the admin certificate) along; on the CLI's
    # default gateway address no flag is needed.
    from squall_server.cli import DEFAULT_GATEWAY

    if app_tls:
        target = f" --config {local_path}"
    elif gateway_address == DEFAULT_GATEWAY:
        target = ""
    else:
        target = f" --gateway {gateway_address}"
        configured = load_config(config_path).gateways[0].address
        if configured == DEFAULT_GATEWAY and not free_ports:
            print(f"\n(note: {configured} was in use, so the gateway listens on {gateway_address})")
    print(f"\nTry:  .venv/bin/squall status{target}")
    print(f"      .venv/bin/squall subscribe demo{target} --count 5")
    print("Stop: make stop")
    return 0


def wait_for_master(
    gateway_address: str, timeout_s: float = 30.0, tls: squall.TlsOptions | None = None
) -> str:
    """Waits until the gateway reports an elected master; returns its node id."""
    import squall

    deadline = time.monotonic() + timeout_s
    with squall.connect(gateway_address, tls=tls) as client:
        while time.monotonic() < deadline:
            try:
                master = client.status().master_id
            except squall.SquallError:
                master = ""
            if master:
                return master
            time.sleep(0.1)
    raise TimeoutError(f"no master was elected within {timeout_s:.0f}s")


def print_status(gateway_address: str, config_path: Path | None = None) -> None:
    """Prints `squall status` (IceStorm's replica table) for the running cluster."""
    from squall_server import cli

    extra = ["--config", str(config_path)] if config_path is not None else []
    cli.main(["status", "--gateway", gateway_address, "--timeout", "5", *extra])


def _demo(
    config: ClusterConfig, gateway_address: str, tls: squall.TlsOptions | None = None
) -> None:
    """Creates a topic, publishes a few events and reads them back, saying what it does."""
    import squall

    with squall.connect(gateway_address, tls=tls) as client:
        name = "demo"
        try:
            client.create_topic(name)
            print(f"\ndemo: created topic '{name}'")
        except squall.AlreadyExists:
            print(f"\ndemo: topic '{name}' exists already (data from an earlier run is kept)")
        topic = client.topic(name)
        start_offset = topic.info.next_offset
        publisher = topic.publisher()
        stamp = time.strftime("%H:%M:%S")
        for i in range(5):
            receipt = publisher.publish(f"hello {i} at {stamp}".encode(), key=f"k{i}".encode())
            print(
                f"demo: published offset={receipt.offset} lsn={receipt.lsn} "
                f"epoch={receipt.epoch} (acknowledged once durable)"
            )
        publisher.close()
        print(f"demo: reading from offset {start_offset}:")
        with topic.subscribe(start=start_offset, follow=False) as subscription:
            for message in subscription:
                print(
                    f"  offset={message.offset} key={message.key.decode()} "
                    f"payload={message.payload.decode()}"
                )


def stop() -> int:
    """Shuts the cluster down cleanly, then stops every service left in .run/pids.json by
    PID."""
    if not PIDS_FILE.exists():
        print("squall: no local cluster is running")
        return 0
    if _running_pids():
        _clean_shutdown()
    entries = json.loads(PIDS_FILE.read_text())
    # Gateways first, so apps see one clean refusal rather than a half-stopped cluster.
    for entry in sorted(entries, key=lambda e: e["kind"] != "gateway"):
        was_running = processes.stop_pid(int(entry["pid"]))
        state = "stopped" if was_running else "already stopped"
        print(f"{entry['kind']} {entry['name']} (pid {entry['pid']}) {state}")
    PIDS_FILE.unlink()
    return 0


def _clean_shutdown() -> None:
    """`squall cluster shutdown` on the local cluster; a failure is reported, not fatal."""
    from squall_server.cli.cluster_shutdown import ShutdownError, shutdown_cluster

    try:
        config = load_config(LOCAL_CONFIG)
    except ConfigError as exc:
        print(f"squall: no clean shutdown ({LOCAL_CONFIG}: {exc})", file=sys.stderr)
        return
    try:
        status = shutdown_cluster(config, sys.stdout, timeout_s=30.0)
    except ShutdownError as exc:
        print(f"squall: no clean shutdown: {exc}", file=sys.stderr)
        return
    if status != 0:
        print("squall: the master's store was not marked clean (see above)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(
        prog="deploy.launcher",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start_parser = sub.add_parser("start", help="start a local cluster")
    start_parser.add_argument("--config", type=Path, default=Path("deploy/single.toml"))
    start_parser.add_argument("--demo", action="store_true", help="run the short demo")
    start_parser.add_argument(
        "--tls", action="store_true", help="TLS on every link, with development certificates"
    )
    start_parser.add_argument(
        "--free-ports",
        action="store_true",
        help="put the gateway on a free port too (by default it keeps the configured one, "
        "the `squall` command's default, when that port is free)",
    )
    sub.add_parser("stop", help="stop the local cluster")
    args = parser.parse_args(argv)
    if args.command == "start":
        return start(args.config, args.demo, args.tls, args.free_ports)
    return stop()


if __name__ == "__main__":
    sys.exit(main())
