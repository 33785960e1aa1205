"""`squall certs dev DIR`: a development CA and certificates for a cluster's members.

The work is in squall_server.common.dev_certs, imported only when the command runs, so other
commands do not load the cryptography library.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from squall_server.common.config import ConfigError, load_config


class CertsError(Exception):
    """`squall certs` cannot do what was asked; the message says why."""


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds `certs dev`."""
    certs = commands.add_parser("certs", help="make TLS certificates (development CA)")
    actions = certs.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    dev = actions.add_parser(
        "dev",
        help="a local CA plus a certificate for every node, gateway and admin (testing only)",
    )
    dev.add_argument("dir", metavar="DIR", help="directory to write ca.crt and <id>.crt/.key")
    dev.add_argument("--config", metavar="FILE", help="cluster TOML: one cert per node/gateway")
    dev.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="NAME[@HOST,...]",
        help="also a client certificate NAME (apps using publisher proxies); HOSTs it also "
        "names, for a push endpoint the cluster dials there; repeatable",
    )
    dev.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    dev.add_argument("--force", action="store_true", help="overwrite existing files")
    certs.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """`squall certs dev`; 0 on success, 1 with one line on stderr otherwise."""
    config = None
    if args.config:
        try:
            config = load_config(args.config)
        except ConfigError as error:
            raise CertsError(f"config error: {args.config}: {error}") from None
    if config is None and not args.client:
        print(
            "squall certs dev: no --config given; only the CA and the admin certificate are made",
            file=out,
        )
    from squall_server.common import dev_certs

    directory = Path(args.dir).absolute()
    try:
        made = dev_certs.subjects(config, list(args.client))
        dev_certs.make_dev_certs(directory, made, days=args.days, force=args.force)
    except (dev_certs.CertsError, OSError) as error:
        raise CertsError(str(error)) from None
    print(
        f"wrote {directory}/ca.crt and certificates for "
        f"{', '.join(s.identity for s in made)} (development only; keys are 0600)",
        file=out,
    )
    print(
        f'use them with:\n[tls]\nenabled = true\nca_file = "{directory}/ca.crt"\n'
        f'cert_dir = "{directory}"',
        file=out,
    )
    return 0
