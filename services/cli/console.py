"""`squall console`: serve the web console (docs/console.md) for the cluster behind a gateway.

    squall console [--listen HOST:PORT] [--gateway ADDR | --config FILE] [--token-file FILE]
                   [--poll-ms MS] [--https-cert FILE --https-key FILE]

It finds the gateway, TLS and the token exactly as the other client commands do; with a
token, the page asks for the same token. Operator actions need --config, as `squall
cluster` does. Stops on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import ssl
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, TextIO

import squall
from squall_server.cli import auth as cli_auth
from squall_server.common.config import CONSOLE_POLL_MS_MAX, CONSOLE_POLL_MS_MIN, is_loopback_host

if TYPE_CHECKING:
    from squall_server.console.backend import ConsoleBackend
    from squall_server.console.server import ConsoleServer

DEFAULT_LISTEN = "127.0.0.1:7180"


def parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT ([v6]:PORT for IPv6); ValueError naming what is wrong."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--listen must be HOST:PORT, not {value!r}")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--listen port must be a number, not {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--listen port must be 0-65535, not {port}")
    return host, port


def add_parser(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    client: argparse.ArgumentParser,
) -> None:
    """Adds `squall console` (a client command: --gateway, --config, --token-file)."""
    console = commands.add_parser(
        "console", parents=[client], help="serve the web console (docs/console.md)"
    )
    console.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"where to serve the page (default {DEFAULT_LISTEN}; port 0 picks a free one)",
    )
    console.add_argument(
        "--poll-ms",
        type=int,
        default=1000,
        metavar="MS",
        help=f"how often to poll the gateway ({CONSOLE_POLL_MS_MIN}-{CONSOLE_POLL_MS_MAX}, "
        "default 1000)",
    )
    console.add_argument("--https-cert", metavar="FILE", help="serve HTTPS with this cert (PEM)")
    console.add_argument("--https-key", metavar="FILE", help="and this private key (PEM)")
    console.set_defaults(handler=run)


def https_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The HTTPS context for --https-cert/--https-key (both or neither); ValueError if bad."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("--https-cert and --https-key go together")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"cannot load the HTTPS certificate {cert} and key {key}: {err}") from None
    return context


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Serves the console until interrupted; returns the exit status."""
    # Imported here: `squall` commands that do not serve the console should not load it.
    from squall_server.cli.command import UsageError, resolve_gateway, tls_from_config
    from squall_server.console.backend import ConsoleBackend
    from squall_server.console.server import ConsoleServer

    try:
        host, port = parse_listen(args.listen)
        context = https_context(args.https_cert, args.https_key)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not CONSOLE_POLL_MS_MIN <= args.poll_ms <= CONSOLE_POLL_MS_MAX:
        raise UsageError(
            f"--poll-ms must be {CONSOLE_POLL_MS_MIN}-{CONSOLE_POLL_MS_MAX}, not {args.poll_ms}"
        )
    token = cli_auth.cli_token()
    if not is_loopback_host(host) and token is None:
        raise UsageError(
            f"--listen {args.listen} is not a loopback address: give the console a token "
            "(--token-file) so the page asks for it, or listen on 127.0.0.1"
        )
    address = resolve_gateway(args)
    try:
        tls = tls_from_config(args, address)
        client = squall.connect(address, timeout_s=args.timeout, tls=tls, token=token)
    except ValueError as err:
        raise UsageError(str(err)) from None
    with client:
        backend = ConsoleBackend(client, config_path=args.config, poll_interval_ms=args.poll_ms)
        try:
            server = ConsoleServer((host, port), backend, token, context)
        except OSError as err:
            raise UsageError(f"cannot listen on {args.listen}: {err.strerror or err}") from None
        return serve(server, backend, out)


def serve(server: ConsoleServer, backend: ConsoleBackend, out: TextIO) -> int:
    """Runs the poller and the HTTP server until SIGTERM or Ctrl-C."""
    stop = threading.Event()
    poller = threading.Thread(
        target=backend.run_poller, args=(stop,), name="console-poller", daemon=True
    )
    poller.start()

    def _terminate(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    print(f"squall console: serving {server.url} (gateway {backend.gateway})", file=out)
    out.flush()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        server.stopping.set()
        server.server_close()
        print("squall console: stopped", file=sys.stderr)
    return 0
