"""Start-up checks of the permissions on a node's data directory and private key files.

A data directory holds the store, the coordinator's election state and the fault record:
a local user who can write it can replace any of them, and one who can read it reads every
event. A private key readable by others is no longer private. Each problem is logged once,
at start-up, as a WARNING that names the path, its mode or owner, and the command that
fixes it.

Squall warns and keeps starting rather than refusing (docs/operations.md, "Start-up
checks"): a node that will not restart after someone loosened a directory is an outage of
its own, and the warning says exactly what to run. The checks only read metadata (stat);
they never change a mode themselves. A directory the replica creates itself is created
0700 (``make_private_dir``), so a fresh node starts clean.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from squall_server.common.config import TlsConfig

log = logging.getLogger("squall.file_checks")

# What a fresh data directory is created with: the owner only.
PRIVATE_DIR_MODE = 0o700


def _mode_text(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"


def data_dir_problems(path: Path) -> list[str]:
    """What is wrong with a data directory's permissions, one sentence each (none: fine)."""
    try:
        info = path.stat()
    except OSError as exc:
        return [f"data directory {path} cannot be checked: {exc.strerror or exc}"]
    problems: list[str] = []
    mode = info.st_mode
    if not stat.S_ISDIR(mode):
        return [f"data directory {path} is not a directory"]
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "world" if mode & stat.S_IWOTH else "group"
        problems.append(
            f"data directory {path} is {who}-writable (mode {_mode_text(mode)}): other local "
            f"users can replace the store; fix with: chmod 700 {path}"
        )
    elif mode & stat.S_IROTH:
        problems.append(
            f"data directory {path} is world-readable (mode {_mode_text(mode)}): other local "
            f"users can read every event; fix with: chmod 700 {path}"
        )
    uid = os.geteuid()
    if info.st_uid != uid:
        problems.append(
            f"data directory {path} is owned by uid {info.st_uid}, not by uid {uid} that "
            f"runs this service; fix with: chown -R {uid} {path}"
        )
    return problems


def key_file_problems(path: Path) -> list[str]:
    """What is wrong with a private key file's permissions (none: fine)."""
    try:
        info = path.stat()
    except OSError as exc:
        return [f"private key {path} cannot be checked: {exc.strerror or exc}"]
    mode = info.st_mode
    problems: list[str] = []
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        readable = (
            "readable by other users"
            if mode & (stat.S_IRGRP | stat.S_IROTH)
            else "open to other users"
        )
        problems.append(
            f"private key {path} is {readable} (mode {_mode_text(mode)}); "
            f"fix with: chmod 600 {path}"
        )
    uid = os.geteuid()
    if info.st_uid != uid:
        problems.append(
            f"private key {path} is owned by uid {info.st_uid}, not by uid {uid} that runs "
            f"this service; fix with: chown {uid} {path}"
        )
    return problems


def check_data_dir(path: Path, service: str) -> list[str]:
    """Logs a WARNING for each problem with a data directory; returns the problems."""
    problems = data_dir_problems(path)
    for problem in problems:
        log.warning("%s start-up check: %s", service, problem)
    return problems


def check_key_files(paths: Iterable[Path], service: str = "squall") -> list[str]:
    """Logs a WARNING for each problem with the private key files; returns the problems."""
    problems = [problem for path in paths for problem in key_file_problems(Path(path))]
    for problem in problems:
        log.warning("%s start-up check: %s", service, problem)
    return problems


def check_own_key(tls: TlsConfig, identity: str, service: str) -> list[str]:
    """With [tls] on, warns about the service's own private key (`<cert_dir>/<id>.key`)."""
    if not tls.enabled or tls.cert_dir is None:
        return []
    return check_key_files([tls.cert_dir / f"{identity}.key"], service)


def make_private_dir(path: Path) -> None:
    """Creates a data directory (and missing parents) with mode 0700 when it is missing.

    An existing directory is left as it is (check_data_dir reports on it).
    """
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE)
    except FileExistsError:
        return
    # mkdir's mode is masked by the umask; 0700 is already the tightest it can make it,
    # but a umask that removes the owner's bits would leave it unusable.
    os.chmod(path, PRIVATE_DIR_MODE)
