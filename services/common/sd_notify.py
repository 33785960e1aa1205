"""systemd's readiness protocol (sd_notify) without a dependency: a service under a
`Type=notify` unit tells systemd READY=1 once it serves and STOPPING=1 as it shuts down.

systemd passes the socket's path in $NOTIFY_SOCKET (a leading "@" means Linux's abstract
namespace); each message is one datagram of newline-separated KEY=VALUE lines. Outside
systemd (no $NOTIFY_SOCKET) every call is a no-op, and a socket that cannot be reached is
a logged warning, never a reason for a service to stop.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("squall")

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def notify(*lines: str) -> bool:
    """Sends lines (e.g. "READY=1", "STATUS=...") to $NOTIFY_SOCKET; True if sent."""
    address = os.environ.get(NOTIFY_SOCKET_ENV, "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        # systemd also speaks vsock ("vsock:CID:PORT") to VMs; Squall runs on the host.
        log.warning("%s=%s is not a Unix socket path; not notifying", NOTIFY_SOCKET_ENV, address)
        return False
    message = "\n".join(lines).encode("utf-8")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message)
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", os.environ[NOTIFY_SOCKET_ENV], exc)
        return False
    return True


def ready(status: str) -> bool:
    """The service serves: systemd's start job completes (units ordered after it go on)."""
    return notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")


def stopping(status: str) -> bool:
    """The service is shutting down: systemd shows the unit deactivating."""
    return notify("STOPPING=1", f"STATUS={status}")
