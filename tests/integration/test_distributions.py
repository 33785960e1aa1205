"""The two distributions, built as `make dist` builds them and installed from their wheels
into fresh virtual environments, as a user would get them.

* The client, `squall`: `import squall` (its generated stubs, squall.aio, squall.wire)
  works with nothing installed but grpcio, protobuf, tenacity and opentelemetry-api and
  what they need; no server dependency (lmdb, cryptography, the OpenTelemetry SDK) comes
  with it; the Spark data source needs the `spark` extra.
* The server, `squall-server`: installs as `squall_server` (no top-level `services`),
  brings the `squall` console script, and runs: `squall --version`, `squall config check`
  of a shipped config, and `python -m squall_server.<service> --help`.

Offline: the environments get their dependencies from the ones this test runs in
(installed with constraints.txt), each distribution's own, mirrored file by file into a
folder the new environment reads through a .pth, so only what the dependency closure
names is importable there; `pip check` then proves every declared requirement is met by
those versions. No package index is asked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scripts.build_dists import build

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLIENT_BASE = {"grpcio", "protobuf", "tenacity", "opentelemetry-api"}
OURS = {"squall", "squall-server"}
COMMAND_TIMEOUT_S = 120


def _requirements(dist: str, extras: Iterable[str] = ()) -> list[Requirement]:
    """What an installed distribution requires, with the given extras."""
    found = []
    for text in metadata.requires(dist) or []:
        requirement = Requirement(text)
        wanted = requirement.marker is None or any(
            requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras)
        )
        if wanted:
            found.append(requirement)
    return found


def _closure(roots: Iterable[Requirement]) -> set[str]:
    """The distributions (canonical names) that satisfy roots, recursively, from this
    environment; our own two are left out (they come from the wheels)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in OURS:
            todo.extend(_requirements(name, requirement.extras))
            continue
        if name in seen:
            continue
        seen.add(name)
        todo.extend(_requirements(name, requirement.extras))
    return seen


def _mirror(dists: Iterable[str], into: Path) -> None:
    """Links every file of each installed distribution into `into`, at the same relative
    path as in site-packages (a namespace package such as opentelemetry gets only the
    files of the distributions named)."""
    for name in dists:
        dist = metadata.distribution(name)
        for file in dist.files or []:
            if ".." in file.parts or "__pycache__" in file.parts:
                continue  # console scripts outside site-packages, caches
            source = Path(str(file.locate()))
            if not source.is_file():
                continue
            target = into / file
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(source)


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"{argv}:\n{result.stdout}{result.stderr}"
    return result.stdout


def _environment(where: Path, dists: set[str], wheels: list[Path]) -> Path:
    """A fresh venv with the wheels installed and dists visible; its python."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(where / "venv")], where)
    python = where / "venv" / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where
    ).strip()
    _mirror(dists, where / "deps")
    Path(purelib, "squall-test-deps.pth").write_text(f"{where / 'deps'}\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    # Without the repository on PYTHONPATH (a test before may have left it there): pip
    # would take our own distributions for installed and skip or count them.
    env = _clean_env()
    _run([*pip, "install", "--quiet", "--no-deps", "--no-index", *map(str, wheels)], where, env)
    _run([*pip, "check"], where, env)  # every requirement of every installed dist is met
    return python


def _clean_env() -> dict[str, str]:
    """This environment without anything that would let the new one see the repository."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    built = build(tmp_path_factory.mktemp("dist"))
    by_name = {re.sub(r"-\d.*", "", wheel.name): wheel for wheel in built}
    assert set(by_name) == {"squall", "squall_server"}, built
    return by_name


def test_the_client_wheel_needs_only_what_a_client_needs_and_spark_needs_its_extra(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    declared = {canonicalize_name(r.name) for r in _requirements_of_wheel(wheels["squall"])}
    assert declared == CLIENT_BASE
    python = _environment(
        tmp_path, _closure(Requirement(n) for n in CLIENT_BASE), [wheels["squall"]]
    )
    probe = """
import importlib.util, squall, squall.aio, squall.wire.retry, squall.wire.trace_context
from squall.v1 import broker_pb2, broker_pb2_grpc
assert squall.__file__.startswith(SITE), squall.__file__
print(squall.__version__)
for name in ("lmdb", "cryptography", "opentelemetry.sdk", "squall_server", "services"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable"
try:
    import squall.spark
except ModuleNotFoundError as error:
    print("spark needs the extra:", error.name in ("pyspark", "pyarrow"))
"""
    purelib = sysconfig.get_paths()["purelib"].replace(sys.prefix, str(tmp_path / "venv"))
    out = _run([str(python), "-c", probe.replace("SITE", repr(purelib))], tmp_path, _clean_env())
    assert out.splitlines() == [_version(), "spark needs the extra: True"]

    # The same environment with what the `spark` extra adds: the data source loads.
    _mirror(_closure([Requirement("squall[spark]")]), tmp_path / "deps")
    _run([sys.executable, "-m", "pip", "--python", str(python), "check"], tmp_path, _clean_env())
    out = _run(
        [str(python), "-c", "import squall.spark; print(squall.spark.SquallDataSource.name())"],
        tmp_path,
        _clean_env(),
    )
    assert out.strip() == "squall"


def test_the_server_installs_as_squall_server_with_the_squall_command(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    roots = _requirements_of_wheel(wheels["squall_server"])
    assert "squall" in {canonicalize_name(r.name) for r in roots}
    python = _environment(tmp_path, _closure(roots), [wheels["squall"], wheels["squall_server"]])
    bin_dir = python.parent
    env = _clean_env()
    site = Path(
        _run(
            [str(python), "-c", "import squall_server; print(squall_server.__file__)"],
            tmp_path,
            env,
        ).strip()
    ).parents[1]
    assert site.is_relative_to(tmp_path / "venv"), site
    assert not (site / "services").exists(), "a top-level `services` was installed"
    assert (site / "squall_server" / "replica" / "store").is_dir()
    assert _run([str(bin_dir / "squall"), "--version"], tmp_path, env).strip() == (
        f"squall {_version()}"
    )
    checked = _run(
        [str(bin_dir / "squall"), "config", "check", str(ROOT / "deploy" / "single.toml")],
        tmp_path,
        env,
    )
    assert "single.toml" in checked
    for service in ("replica", "coordinator", "gateway"):
        usage = _run([str(python), "-m", f"squall_server.{service}", "--help"], tmp_path, env)
        assert "--config" in usage


def _requirements_of_wheel(wheel: Path) -> list[Requirement]:
    """The base requirements (no extra) a wheel declares in its METADATA."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    found = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist: "):
            requirement = Requirement(line.removeprefix("Requires-Dist: "))
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                found.append(requirement)
    return found


def _version() -> str:
    import squall

    return squall.__version__
