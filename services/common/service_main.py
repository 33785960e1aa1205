"""The shared entry point of every Squall service process: arguments, config, logs, run.

Every service takes `--config FILE` and its id, refuses a broken file with one line and
exit status 2 before anything starts, logs with its name and id, starts the telemetry
`[telemetry]` asks for (before anything that records spans or metrics is built), runs
until SIGTERM or SIGINT, and exits 1 with a logged reason if it cannot start or stops
itself (``FailStop``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable

from squall_server.common.config import ClusterConfig, NodeConfig, load_config_or_exit
from squall_server.common.grpc_server import run_until_signalled
from squall_server.common.logs import set_log_context, setup_logging
from squall_server.common.telemetry import TelemetryHandle, start_telemetry

log = logging.getLogger("squall")

Serve = Callable[[asyncio.Event], Awaitable[None]]


class FailStop(Exception):
    """The service stopped itself, having logged why: it exits with status 1 (a service
    manager starts it again)."""


def run_service(
    service: str,
    name: str,
    serve: Serve,
    startup_errors: tuple[type[Exception], ...] = (),
    config: ClusterConfig | None = None,
) -> int:
    """Runs `serve(stop)` until a signal, with config's telemetry; returns the exit status."""
    expected: tuple[type[Exception], ...] = (*startup_errors, OSError)
    handle: TelemetryHandle | None = None
    try:
        if config is not None:
            handle = start_telemetry(config, service, name)
        asyncio.run(run_until_signalled(serve))
    except FailStop as exc:
        log.error("%s %s exits after its fail-stop: %s", service, name, exc)
        return 1
    except expected as exc:
        log.error("%s %s cannot start: %s", service, name, exc)
        return 1
    finally:
        set_log_context(None)
        if handle is not None:
            handle.shutdown()
    return 0


def node_service_main(
    service: str,
    description: str | None,
    argv: list[str] | None,
    serve: Callable[[ClusterConfig, NodeConfig, asyncio.Event], Awaitable[None]],
    startup_errors: tuple[type[Exception], ...] = (),
) -> int:
    """`squall SERVICE --config FILE --node ID`: the main() of a per-node service."""
    parser = argparse.ArgumentParser(prog=f"squall {service}", description=description)
    parser.add_argument("--config", required=True, help="cluster configuration file (TOML)")
    parser.add_argument("--node", required=True, help="this node's id in the configuration")
    args = parser.parse_args(argv)
    config = load_config_or_exit(args.config, node_id=args.node)
    node = config.node(args.node)
    setup_logging(config.logging, service, node.id)
    return run_service(
        service, node.id, lambda stop: serve(config, node, stop), startup_errors, config
    )
