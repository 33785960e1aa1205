"""The deployment files in deploy/: systemd units, the container image, the compose file.

Goal: what an operator installs is well-formed and says what docs/deployment.md says —
each unit starts its service with the config path and its instance id, restarts on
failure but not on a broken config (exit status 2), and runs hardened; systemd's own
verifier accepts the units (where systemd-analyze is installed); the image is built in
two stages and runs as a non-root user; the compose file runs three nodes and a gateway
on one network, from a cluster file whose addresses are the containers' names.
Running the units' and the compose file's command lines for real is in
tests/integration/test_deploy_commands.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

import squall
from squall_server.common.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
CONTAINER = ROOT / "deploy" / "container"
SERVICE_UNITS = {
    "replica": "squall-replica@.service",
    "coordinator": "squall-coordinator@.service",
    "gateway": "squall-gateway@.service",
}
INSTALLED_SQUALL = "/opt/squall/venv/bin/squall"
CONFIG_PATH = "/etc/squall/cluster.toml"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (keys may repeat in systemd)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}:{number}: a key before any section"
        assert "=" in line and not line.endswith("\\"), f"{path.name}:{number}: {line!r}"
        key, value = (part.strip() for part in line.split("=", 1))
        current.setdefault(key, []).append(value)
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"[{section}] {key}: {values}"
    return values[0]


def exec_start(kind: str) -> list[str]:
    """The unit's ExecStart as argv (before systemd expands %i and ${...})."""
    return shlex.split(one(parse_unit(SYSTEMD / SERVICE_UNITS[kind]), "Service", "ExecStart"))


@pytest.mark.parametrize("kind", sorted(SERVICE_UNITS))
def test_each_unit_starts_its_service_from_the_config_with_its_instance_id(kind: str) -> None:
    unit = parse_unit(SYSTEMD / SERVICE_UNITS[kind])
    flag = "--gateway" if kind == "gateway" else "--node"
    assert exec_start(kind) == [INSTALLED_SQUALL, kind, "--config", "${SQUALL_CONFIG}", flag, "%i"]
    assert one(unit, "Service", "Environment") == f"SQUALL_CONFIG={CONFIG_PATH}"
    # An optional file may override the config path ("-": missing is fine).
    assert one(unit, "Service", "EnvironmentFile") == "-/etc/default/squall"
    # READY=1 / STOPPING=1 over $NOTIFY_SOCKET (tests/integration/test_sd_notify.py).
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert one(unit, "Service", "TimeoutStartSec").rstrip("s").isdigit()
    assert (one(unit, "Service", "User"), one(unit, "Service", "Group")) == ("squall", "squall")


@pytest.mark.parametrize("kind", sorted(SERVICE_UNITS))
def test_each_unit_restarts_on_failure_within_limits_but_not_on_a_config_error(kind: str) -> None:
    unit = parse_unit(SYSTEMD / SERVICE_UNITS[kind])
    assert one(unit, "Service", "Restart") == "on-failure"
    assert "2" in one(unit, "Service", "RestartPreventExitStatus").split()
    assert 1 <= int(one(unit, "Unit", "StartLimitBurst")) <= 10
    assert one(unit, "Unit", "StartLimitIntervalSec").rstrip("s").isdigit()
    assert one(unit, "Service", "RestartSec") == "2s"
    assert one(unit, "Service", "KillSignal") == "SIGTERM"


@pytest.mark.parametrize("kind", sorted(SERVICE_UNITS))
def test_each_unit_is_hardened(kind: str) -> None:
    service = parse_unit(SYSTEMD / SERVICE_UNITS[kind])["Service"]
    required = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "CapabilityBoundingSet": "",
        "SystemCallArchitectures": "native",
    }
    assert {key: service.get(key, ["(unset)"])[-1] for key in required} == required
    assert "@system-service" in service["SystemCallFilter"]
    assert service["RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX"]
    assert service["UMask"] == ["0027"]
    # No escape hatches: nothing runs as root, no path is opened up beyond the data dir.
    assert not {"ExecStartPre", "ExecStartPost", "PermissionsStartOnly", "ReadWritePaths"} & set(
        service
    )
    if kind == "gateway":
        assert "StateDirectory" not in service  # writes nothing at all
    else:
        assert service["StateDirectory"] == ["squall/%i"]
        assert service["WorkingDirectory"] == ["/var/lib/squall/%i"]


def test_the_node_target_groups_a_nodes_two_services() -> None:
    target = parse_unit(SYSTEMD / "squall-node@.target")
    wanted = one(target, "Unit", "Wants").split()
    assert wanted == ["squall-replica@%i.service", "squall-coordinator@%i.service"]
    for kind in ("replica", "coordinator"):
        unit = parse_unit(SYSTEMD / SERVICE_UNITS[kind])
        assert one(unit, "Unit", "PartOf") == "squall-node@%i.target"
    coordinator = parse_unit(SYSTEMD / SERVICE_UNITS["coordinator"])
    assert "squall-replica@%i.service" in one(coordinator, "Unit", "After").split()
    sysusers = (SYSTEMD / "squall.sysusers.conf").read_text()
    assert re.search(r"^u squall - .* /var/lib/squall /usr/sbin/nologin$", sysusers, re.M)


def _systemd_root(tmp_path: Path) -> Path:
    """A file-system root holding the units and the real `squall` entry point where the
    units expect it, for systemd-analyze --root."""
    root = tmp_path / "root"
    units = root / "etc" / "systemd" / "system"
    units.mkdir(parents=True)
    for unit in SYSTEMD.glob("squall-*@.*"):
        shutil.copy(unit, units / unit.name)
    program = root / INSTALLED_SQUALL.lstrip("/")
    program.parent.mkdir(parents=True)
    shutil.copy(Path(sys.executable).parent / "squall", program)
    return root


INSTANCES = [
    "squall-replica@n1.service",
    "squall-coordinator@n1.service",
    "squall-gateway@g1.service",
    "squall-node@n1.target",
]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_verifies_the_units(tmp_path: Path) -> None:
    root = _systemd_root(tmp_path)
    result = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            f"--root={root}",
            "--man=no",
            "--recursive-errors=no",
            *INSTANCES,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Any unknown key, bad value or missing program is printed, and fails the verify.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_rates_the_services_exposure_low(tmp_path: Path) -> None:
    root = _systemd_root(tmp_path)
    for instance in INSTANCES[:3]:
        result = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", f"--root={root}", instance],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        match = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", result.stdout)
        assert match, result.stdout + result.stderr
        # systemd's scale: 0 (safe) .. 10 (exposed); below 2 is "OK".
        assert float(match.group(1)) < 2.0, f"{instance}: {match.group(0)}"


# --- the container image


def dockerfile_stages() -> list[tuple[str, list[str]]]:
    """(FROM line, instructions) per stage, continuation lines joined."""
    text = (CONTAINER / "Dockerfile").read_text()
    logical = re.sub(r"\\\n\s*", " ", text)
    stages: list[tuple[str, list[str]]] = []
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append((line, []))
        elif stages:
            stages[-1][1].append(line)
    return stages


def test_the_image_builds_in_two_stages_and_runs_as_a_non_root_user() -> None:
    stages = dockerfile_stages()
    assert len(stages) == 2
    assert stages[0][0] == "FROM ${PYTHON_IMAGE} AS build"
    runtime_from, runtime = stages[1]
    assert runtime_from == "FROM ${PYTHON_IMAGE}"
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users == ["10001:10001"]
    assert "COPY --from=build /opt/squall/venv /opt/squall/venv" in runtime
    # Nothing but the environment comes over: no source tree, no build tools.
    assert [line for line in runtime if line.startswith(("COPY", "ADD"))] == [
        "COPY --from=build /opt/squall/venv /opt/squall/venv"
    ]
    assert 'ENTRYPOINT ["squall"]' in runtime
    assert 'VOLUME ["/var/lib/squall"]' in runtime


def test_the_build_stage_generates_the_protos_with_the_pinned_tools() -> None:
    _, build = dockerfile_stages()[0]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = {
        dep.split("==")[0]: dep
        for dep in pyproject["project"]["optional-dependencies"]["dev"]
        if dep.startswith(("grpcio-tools", "mypy-protobuf"))
    }
    tools = next(line for line in build if "/opt/protoc/bin/pip install" in line)
    assert sorted(tools.split("pip install ")[1].split()) == sorted(pins.values())
    assert "RUN /opt/protoc/bin/python scripts/gen_protos.py" in build
    generate = build.index("RUN /opt/protoc/bin/python scripts/gen_protos.py")
    install = next(
        i
        for i, line in enumerate(build)
        if "venv/bin/pip install -c constraints.txt ./clients ." in line
    )
    assert generate < install, "the package must be built from freshly generated code"


def test_every_file_the_build_copies_exists_and_passes_the_dockerignore() -> None:
    _, build = dockerfile_stages()[0]
    # COPY SOURCE... DEST: every word between the instruction and the destination.
    sources = [s for line in build if line.startswith("COPY ") for s in line.split()[1:-1]]
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert any(
            source.rstrip("/") == entry or source.startswith(entry + "/") for entry in allowed
        ), f"{source} is excluded from the build context by .dockerignore"
    # The package metadata needs the README (pyproject's readme).
    assert "README.md" in sources


# --- the compose file


def compose() -> dict[str, object]:
    document = yaml.safe_load((CONTAINER / "compose.yaml").read_text())
    assert isinstance(document, dict)
    return document


def test_compose_runs_every_service_of_the_cluster_file_in_its_own_container() -> None:
    services: dict[str, dict[str, object]] = compose()["services"]  # type: ignore[assignment]
    config = load_config(CONTAINER / "cluster.toml")
    expected = {f"{kind}-{n.id}" for n in config.nodes for kind in ("replica", "coordinator")}
    expected |= {f"gateway-{g.id}" for g in config.gateways}
    assert set(services) == expected
    for node in config.nodes:
        for kind, address in (
            ("replica", node.replica_address),
            ("coordinator", node.coordinator_address),
        ):
            name = f"{kind}-{node.id}"
            service = services[name]
            assert service["command"] == [kind, "--config", CONFIG_PATH, "--node", node.id]
            # The address it listens on and the others dial is its own container's name.
            assert address.split(":")[0] == name == service["hostname"]
            healthcheck: dict[str, object] = service["healthcheck"]  # type: ignore[assignment]
            assert healthcheck["test"] == ["CMD", "squall", "health", address]
    for gateway in config.gateways:
        service = services[f"gateway-{gateway.id}"]
        assert service["command"] == ["gateway", "--config", CONFIG_PATH, "--gateway", gateway.id]
        assert gateway.address.split(":")[0] == service["hostname"]


def test_compose_gives_each_node_one_volume_holding_its_data_dir() -> None:
    document = compose()
    services: dict[str, dict[str, object]] = document["services"]  # type: ignore[assignment]
    config = load_config(CONTAINER / "cluster.toml")
    declared = set(document["volumes"])  # type: ignore[arg-type]
    used: dict[str, set[str]] = {}
    for name, service in services.items():
        mounts: list[object] = service["volumes"]  # type: ignore[assignment]
        config_mount = next(m for m in mounts if isinstance(m, dict))
        assert config_mount == {
            "type": "bind",
            "source": "./cluster.toml",
            "target": CONFIG_PATH,
            "read_only": True,
        }
        assert (CONTAINER / str(config_mount["source"])).is_file()
        for mount in mounts:
            if isinstance(mount, str):
                volume, target = mount.split(":")
                assert volume in declared
                used.setdefault(volume, set()).add(name)
                node_id = name.split("-", 1)[1]
                # The data_dir lies on the volume (mounted at a directory the image
                # owns, so the volume starts out owned by the squall user).
                assert config.node(node_id).data_dir.parent == Path(target)
    assert used == {
        f"{n.id}-data": {f"replica-{n.id}", f"coordinator-{n.id}"} for n in config.nodes
    }
    # A gateway keeps nothing: it mounts the config file only.
    assert [m for m in services["gateway-g1"]["volumes"] if not isinstance(m, dict)] == []  # type: ignore[attr-defined]


def test_compose_publishes_only_the_gateway_and_runs_every_container_locked_down() -> None:
    services: dict[str, dict[str, object]] = compose()["services"]  # type: ignore[assignment]
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert published == {"gateway-g1": ["127.0.0.1:7100:7100"]}
    builders = [name for name, s in services.items() if "build" in s]
    assert builders == ["replica-n1"]
    assert services["replica-n1"]["build"] == {
        "context": "../..",
        "dockerfile": "deploy/container/Dockerfile",
    }
    for name, service in services.items():
        assert service["image"] == f"squall:{squall.__version__}", name
        assert service["user"] == "10001:10001", name
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        assert service["security_opt"] == ["no-new-privileges:true"], name
        assert service["stop_signal"] == "SIGTERM", name
        assert str(service["restart"]).startswith("on-failure"), name
        for dependency in service.get("depends_on", {}):  # type: ignore[attr-defined]
            assert dependency in services, f"{name} depends on unknown {dependency}"


def test_the_cluster_files_the_launcher_and_chaos_write_read_back_exactly() -> None:
    """deploy.processes.dump_toml (used by the launcher, the chaos suite and the tests)
    writes real TOML: strings a hand-escaper gets wrong read back unchanged."""
    from deploy.processes import dump_toml

    awkward = "C:\\data\\n1 \"quoted\"\nnext line\ttab \u00e9 \x01 'single'"
    document = {
        "cluster_name": awkward,
        "nodes": [{"id": "n1", "data_dir": awkward, "priority": 3}],
        "timeouts": {"replica_timeout_ms": 1500, "ratio": 0.5, "on": True},
        "auth": {"principals": [{"name": "a b", "topics": ["x.*", "y"]}]},
    }
    assert tomllib.loads(dump_toml(document)) == document


def test_make_run_keeps_the_gateways_configured_port_unless_it_is_taken(tmp_path: Path) -> None:
    """`make run`'s gateway listens where the shipped config (and the CLI's default) says,
    when that port is free; otherwise, and for tests, on a free port."""
    import socket

    from deploy.processes import free_port, localize_config

    port = free_port()
    source = tmp_path / "template.toml"
    text = (ROOT / "deploy" / "single.toml").read_text()
    source.write_text(text.replace("127.0.0.1:7100", f"127.0.0.1:{port}"))

    def gateway(keep: bool) -> str:
        path = localize_config(source, tmp_path / "run", keep_gateway=keep)
        return str(tomllib.loads(path.read_text())["gateways"][0]["address"])

    assert gateway(keep=True) == f"127.0.0.1:{port}"
    assert gateway(keep=False) != f"127.0.0.1:{port}"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        taken = gateway(keep=True)
    assert taken != f"127.0.0.1:{port}" and taken.startswith("127.0.0.1:")


@pytest.mark.parametrize("nodes", [3, 5])
def test_the_chaos_suites_cluster_file_is_one_the_services_accept(
    nodes: int, tmp_path: Path
) -> None:
    from chaos.cluster import GATEWAY_IDS, ChaosCluster
    from squall_server.common.config import load_config

    cluster = ChaosCluster.build(tmp_path, nodes, None)
    config = load_config(cluster.config_path)
    assert [node.id for node in config.nodes] == [f"n{i}" for i in range(1, nodes + 1)]
    assert [gateway.id for gateway in config.gateways] == list(GATEWAY_IDS)
