"""The `squall` command line (the console script and `python -m squall_server`): start a service,
or talk to a cluster through a gateway.

`command` holds the parser and the dispatch; each other module here is one command group
(`admin` for the operator controls, `store` and `store_backup` for a node's store,
`cluster_shutdown` for `squall cluster shutdown`, ...). `main` is the entry point.
"""

from squall_server.cli.command import (
    DEFAULT_GATEWAY,
    GATEWAY_ENV,
    SERVICE_MODULES,
    build_parser,
    gateway_from_config,
    main,
    resolve_gateway,
    tls_from_config,
)

__all__ = [
    "DEFAULT_GATEWAY",
    "GATEWAY_ENV",
    "SERVICE_MODULES",
    "build_parser",
    "gateway_from_config",
    "main",
    "resolve_gateway",
    "tls_from_config",
]
