"""What some tests need from the machine beyond the venv — Java for Spark, root and
iproute2 for network namespaces — checked once, with the line to print when it is missing.

A test that needs one calls `pytest.skip(reason)` with the reason from here; the summary
hook in tests/conftest.py then prints one line per missing requirement (how many tests it
skipped and what to install), so a newcomer's `make test` says what it did not run. On a
machine that has them (as CI's does) the tests run.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

# PySpark 4 runs on Java 17 or later.
MIN_JAVA = 17
JAVA_PREFIX = "needs Java"
NETNS_PREFIX = "needs network namespaces"
NODE_PREFIX = "needs Node.js"
# How long `java -version` may take on a loaded machine.
_JAVA_VERSION_TIMEOUT_S = 60.0


def _java_binary() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    return shutil.which("java")


@functools.cache
def java_missing() -> str | None:
    """None if a Java new enough for Spark is here, else the skip reason (what to install)."""
    install = (
        f"install Java {MIN_JAVA}+ (Debian/Ubuntu: apt-get install openjdk-{MIN_JAVA}-jre-headless)"
    )
    java = _java_binary()
    if java is None:
        return f"{JAVA_PREFIX} {MIN_JAVA}+ for Spark: no `java` on PATH or in $JAVA_HOME; {install}"
    try:
        result = subprocess.run(
            [java, "-version"],
            capture_output=True,
            text=True,
            timeout=_JAVA_VERSION_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{JAVA_PREFIX} {MIN_JAVA}+ for Spark: `{java} -version` failed ({exc}); {install}"
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if match is None:
        return f"{JAVA_PREFIX} {MIN_JAVA}+ for Spark: `{java} -version` gave no version; {install}"
    major = int(match[1]) if match[1] != "1" else int(match[2] or 0)  # "1.8" is Java 8
    if major < MIN_JAVA:
        return f"{JAVA_PREFIX} {MIN_JAVA}+ for Spark: {java} is Java {major}; {install}"
    return None


@functools.cache
def netns_missing() -> str | None:
    """None if this process may make network namespaces, else the skip reason."""
    from chaos.netns import can_create

    ok, why = can_create()
    if ok:
        return None
    return (
        f"{NETNS_PREFIX} (chaos partitions): {why}; run the tests as root with iproute2 "
        "installed (Debian/Ubuntu: apt-get install iproute2)"
    )


def node_missing(client_dir: Path) -> str | None:
    """None if node and the Node client's packages are here, else the skip reason."""
    if shutil.which("node") is None:
        return (
            f"{NODE_PREFIX} 18+ for the Node client test: no `node` on PATH; install it "
            "(Debian/Ubuntu: apt-get install nodejs npm) and run make test"
        )
    if not (client_dir / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return (
            f"{NODE_PREFIX} packages for the Node client test: {client_dir}/node_modules is "
            "missing; run `make node-deps` (make test does)"
        )
    return None
