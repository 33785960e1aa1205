"""Writes bytecode ahead for every module a Squall process imports (``make bytecode``).

Where the shell sets ``PYTHONDONTWRITEBYTECODE`` (this project's CI machines do), Python
never caches what it compiles, so every process would compile every module it imports
from source again: ~0.3 s of CPU per service process for grpc, protobuf and
OpenTelemetry alone (a replica's imports took 0.77 s of CPU without their bytecode, 0.47 s
with it), paid by every cluster a test, a chaos run or ``make run`` starts. pip installs
without writing bytecode (scripts/venv.sh), so this writes it for:

* our own trees;
* every installed package the server and client distributions need to run (their
  requirements' closure, without extras: not pyspark's thousand modules, nor the tools);
* whatever else a service process imports when it starts (a ``.pth`` file's hook, a
  package grpc looks for and finds because the tools are installed).

compileall writes bytecode whatever ``PYTHONDONTWRITEBYTECODE`` says. Incremental (a file
whose bytecode is current is only stat'ed) and safe: a stale file is compiled again on
import. Silent unless a file does not compile; then it names it and exits 1.

    python scripts/bytecode.py
"""

from __future__ import annotations

import compileall
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWN_TREES = ("services", "clients/squall", "deploy", "chaos", "bench", "scripts", "tests")
ROOTS = ("squall-server", "squall")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(roots: tuple[str, ...] = ROOTS) -> list[metadata.Distribution]:
    """The installed distributions ``roots`` need without extras, roots included."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = _normalize(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        seen[name] = dist
        for requirement in dist.requires or ():
            if "extra" in requirement.partition(";")[2]:
                continue
            match = _NAME.match(requirement)
            if match:
                todo.append(match.group(0))
    return list(seen.values())


def installed_sources(dists: list[metadata.Distribution]) -> list[str]:
    """The ``.py`` files those distributions installed (an editable install's own trees
    are compiled as OWN_TREES)."""
    sources = []
    for dist in dists:
        for file in dist.files or ():
            if file.suffix == ".py":
                path = Path(str(file.locate()))
                if path.is_file():
                    sources.append(str(path))
    return sources


# Prints every module file the three services import at start-up, as a fresh process sees
# them (run in one, so this process's own imports do not count).
_SERVICE_IMPORTS = """
import json, sys
import squall_server.replica.__main__, squall_server.coordinator.__main__
import squall_server.gateway.__main__
print(json.dumps(sorted({
    m.__file__ for m in list(sys.modules.values())
    if getattr(m, "__file__", None) and m.__file__.endswith(".py")
})))
"""


def service_imports() -> list[str]:
    """The ``.py`` files a service process imports at start-up (the standard library's
    included)."""
    result = subprocess.run(
        [sys.executable, "-c", _SERVICE_IMPORTS],
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    files: list[str] = json.loads(result.stdout)
    return files


def main() -> int:
    ok = True
    for tree in OWN_TREES:
        ok &= bool(compileall.compile_dir(ROOT / tree, quiet=1, workers=0))
    stdlib = Path(os.__file__).parent
    started = [f for f in service_imports() if not Path(f).is_relative_to(stdlib)]
    for source in installed_sources(runtime_closure()) + started:
        ok &= bool(compileall.compile_file(source, quiet=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
