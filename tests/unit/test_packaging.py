"""The two distributions' metadata tells the truth: one version everywhere, dependency
floors that the committed generated code accepts, no exact pins in what apps install, a
client that needs only what a client needs, a server that never installs `services`, types
shipped. (tests/integration/test_distributions.py builds and installs the wheels.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import squall
from squall_server import cli

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "clients" / "squall" / "v1"


PYPROJECTS = {"server": ROOT / "pyproject.toml", "client": ROOT / "clients" / "pyproject.toml"}


def _dependencies(which: str = "server") -> dict[str, str]:
    project = tomllib.loads(PYPROJECTS[which].read_text())["project"]
    found: dict[str, str] = {}
    for requirement in project["dependencies"]:
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()
        found[name] = requirement[len(name) :]
    return found


def _version_tuple(text: str) -> tuple[int, ...]:
    """The release numbers of a version (a pre-release tag such as `b2` is left out)."""
    return tuple(int(re.match(r"\d+", part)[0]) for part in text.split("."))  # type: ignore[index]


def _floor(spec: str) -> tuple[int, ...]:
    match = re.search(r">=\s*([0-9a-z.]+)", spec)
    assert match is not None, f"no floor in {spec!r}"
    return _version_tuple(match.group(1))


@pytest.mark.parametrize("which", sorted(PYPROJECTS))
def test_no_dependency_is_pinned_exactly(which: str) -> None:
    pinned = {name: spec for name, spec in _dependencies(which).items() if "==" in spec}
    assert pinned == {}, "a library must not pin exactly; constraints.txt pins installs"


def test_the_client_depends_only_on_what_a_client_needs() -> None:
    assert set(_dependencies("client")) == {"grpcio", "protobuf", "tenacity", "opentelemetry-api"}


def test_the_server_depends_on_a_client_range_that_holds_this_release() -> None:
    spec = _dependencies("server")["squall"]
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", spec).groups()  # type: ignore[union-attr]
    assert _version_tuple(low) <= _version_tuple(squall.__version__) < _version_tuple(high)


def test_the_server_installs_squall_server_from_the_services_folder() -> None:
    setup = (ROOT / "setup.py").read_text()
    assert 'package_dir={"squall_server": "services"}' in setup
    scripts = tomllib.loads(PYPROJECTS["server"].read_text())["project"]["scripts"]
    assert scripts == {"squall": "squall_server.cli:main"}
    # The tree imports the same name through the symlink the rename script made.
    assert (ROOT / "squall_server").resolve() == (ROOT / "services").resolve()


@pytest.mark.parametrize("which", sorted(PYPROJECTS))
def test_grpcio_floor_is_what_the_generated_stubs_require(which: str) -> None:
    required = {
        _version_tuple(re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", p.read_text())[1])  # type: ignore[index]
        for p in GENERATED.glob("*_pb2_grpc.py")
    }
    assert required, "no generated gRPC modules found"
    for name, spec in _dependencies(which).items():
        if name.startswith("grpcio"):
            assert _floor(spec) >= max(required), name


@pytest.mark.parametrize("which", sorted(PYPROJECTS))
def test_protobuf_floor_is_what_the_generated_messages_require(which: str) -> None:
    pattern = re.compile(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),"
        r"\s*(\d+),"
    )
    required = set()
    for path in GENERATED.glob("*_pb2.py"):
        match = pattern.search(path.read_text())
        assert match is not None, path.name
        required.add(tuple(int(g) for g in match.groups()))
    assert _floor(_dependencies(which)["protobuf"]) >= max(required)


@pytest.mark.parametrize("which", sorted(PYPROJECTS))
def test_constraints_pin_every_base_dependency_within_its_range(which: str) -> None:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = _version_tuple(version)
    for name, spec in _dependencies(which).items():
        if name == "squall":
            continue  # the client is built from this tree, with the server
        assert name in pins, f"constraints.txt does not pin {name}"
        if ">=" in spec:
            assert pins[name] >= _floor(spec), name


def test_the_version_is_shown_by_the_cli_and_has_a_changelog_entry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", squall.__version__)
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"squall {squall.__version__}"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {squall.__version__}" in changelog


def test_the_installed_metadata_carries_the_same_version() -> None:
    from importlib.metadata import version

    assert version("squall") == squall.__version__
    assert version("squall-server") == squall.__version__


def test_the_client_package_is_typed() -> None:
    assert (Path(squall.__file__).parent / "py.typed").is_file()
    assert (ROOT / "services" / "py.typed").is_file()
    assert (ROOT / "LICENSE").read_text().startswith(" " * 32 + "Apache License") or (
        "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    )


def test_nothing_still_imports_the_server_by_its_old_name() -> None:
    # A branch written before the rename that says `services.` fails here after a merge:
    # re-run `python3 scripts/rename_server_package.py`.
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "rename_server_package.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
