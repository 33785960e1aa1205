"""The console served by a gateway (`[console] enabled = true`): the same page, backend and
HTTP server as `squall console`, on threads beside the gateway's event loop, calling the
gateway's own public address through the client library like any other client.
"""

from __future__ import annotations

import argparse
import logging
import threading

import squall
from squall.wire.auth import read_token_file
from squall_server.common.config import ClusterConfig, GatewayConfig, parse_address

log = logging.getLogger("squall.console")

# Per-call deadline of the console's own calls to its gateway (as the CLI's default).
HOSTED_CALL_TIMEOUT_S = 10.0


def serves_console(config: ClusterConfig, gateway: GatewayConfig) -> bool:
    """True when [console] is on and names this gateway (or names none and it is first)."""
    console = config.console
    if not console.enabled:
        return False
    return gateway.id == (console.gateway or config.gateways[0].id)


class HostedConsole:
    """A running console inside a gateway process; close() stops it."""

    def __init__(self, config: ClusterConfig, gateway: GatewayConfig) -> None:
        # Imported here: the backend brings the whole CLI, ~40 % of a gateway's import CPU at
        # every start, and most gateways serve no console. The CLI's TLS rules (the cluster
        # CA; the admin certificate where cert_dir has one).
        from squall_server.cli.command import tls_from_config
        from squall_server.console.backend import ConsoleBackend
        from squall_server.console.server import ConsoleServer

        console = config.console
        token = read_token_file(str(console.token_file)) if console.token_file else None
        tls = tls_from_config(argparse.Namespace(config=str(config.path)), gateway.address)
        self._client = squall.connect(
            gateway.address, timeout_s=HOSTED_CALL_TIMEOUT_S, tls=tls, token=token
        )
        self._backend = ConsoleBackend(
            self._client, config_path=str(config.path), poll_interval_ms=console.poll_interval_ms
        )
        host, port = parse_address(console.address)
        self._server = ConsoleServer((host.strip("[]"), port), self._backend, token)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._backend.run_poller, args=(self._stop,), name="console-poller",
                daemon=True,
            ),
            threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                name="console-http", daemon=True,
            ),
        ]  # fmt: skip
        for thread in self._threads:
            thread.start()
        log.info("gateway %s serves the console on %s", gateway.id, self._server.url)

    @property
    def url(self) -> str:
        return self._server.url

    def close(self) -> None:
        """Stops the poller and the HTTP server, then closes the client."""
        self._stop.set()
        self._server.stop()
        for thread in self._threads:
            thread.join(timeout=5)
        self._client.close()
