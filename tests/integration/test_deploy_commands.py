"""The command lines in deploy/ run a working cluster, under the units' restrictions.

Goal: what systemd and compose would run is right — each unit's ExecStart (with %i and
${SQUALL_CONFIG} expanded as systemd does) and each compose service's command start the
three nodes and the gateway of a real cluster from the installed `squall` entry point,
under what the units impose that a plain process can (no new privileges, no memory both
writable and executable, umask 0027), so a unit that passes here does not crash on its
first boot for want of a JIT page; and a broken config makes each of them exit with the
status the units name in RestartPreventExitStatus, so systemd does not restart-loop.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import yaml

import squall
from deploy import processes
from tests.integration.conftest import LocalCluster
from tests.unit.test_deploy_files import (
    CONFIG_PATH,
    CONTAINER,
    INSTALLED_SQUALL,
    SERVICE_UNITS,
    SYSTEMD,
    one,
    parse_unit,
)

pytestmark = pytest.mark.integration

SQUALL = str(Path(sys.executable).parent / "squall")  # this checkout's installed entry point
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_MDWE = 65
_PR_MDWE_REFUSE_EXEC_GAIN = 1


def _mdwe_supported() -> bool:
    """Whether the kernel has PR_SET_MDWE (Linux 6.3+), asked in a throwaway process."""
    probe = (
        "import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
        f"sys.exit(libc.prctl({_PR_SET_MDWE}, {_PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) != 0)"
    )
    return subprocess.run([sys.executable, "-c", probe], check=False, timeout=30).returncode == 0


# Applies NoNewPrivileges=, MemoryDenyWriteExecute= (PR_SET_MDWE, the same rule systemd
# enforces with seccomp) and UMask= (argv[1], octal), then execs argv[2:]: all three are
# kept across exec. A launcher process rather than Popen's preexec_fn, because this test
# process runs gRPC: a preexec_fn makes Popen fork with gRPC's fork handlers, whose
# poller thread can abort the child before its exec (grpc/grpc#43055).
UNIT_RESTRICTIONS = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl({_PR_SET_NO_NEW_PRIVS}, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
if libc.prctl({_PR_SET_MDWE}, {_PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "PR_SET_MDWE")
os.umask(int(sys.argv[1], 8))
os.execvp(sys.argv[2], sys.argv[2:])
"""


def under_unit_restrictions(argv: list[str], umask: int) -> list[str]:
    """argv run under the units' restrictions (``UNIT_RESTRICTIONS``)."""
    return [sys.executable, "-c", UNIT_RESTRICTIONS, f"{umask:o}", *argv]


def expand(argv: list[str], instance: str, environment: Mapping[str, str]) -> list[str]:
    """%i and ${VAR} as systemd expands them in ExecStart; the installed program here."""
    words = [
        re.sub(r"\$\{(\w+)\}", lambda m: environment[m.group(1)], word.replace("%i", instance))
        for word in argv
    ]
    return [SQUALL if words[0] == INSTALLED_SQUALL else words[0], *words[1:]]


def unit_command(kind: str, instance: str, config_path: Path) -> list[str]:
    unit = parse_unit(SYSTEMD / SERVICE_UNITS[kind])
    name, _, default = one(unit, "Service", "Environment").partition("=")
    assert (name, default) == ("SQUALL_CONFIG", CONFIG_PATH)
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    return expand(argv, instance, {"SQUALL_CONFIG": str(config_path)})


def compose_command(kind: str, instance: str, config_path: Path) -> list[str]:
    services = yaml.safe_load((CONTAINER / "compose.yaml").read_text())["services"]
    command: list[str] = services[f"{kind}-{instance}"]["command"]
    return [SQUALL, *(str(config_path) if word == CONFIG_PATH else word for word in command)]


COMMANDS = {"systemd": unit_command, "compose": compose_command}
TEMPLATES = {"systemd": "cluster.example.toml", "compose": "container/cluster.toml"}


def launch(
    cluster: LocalCluster,
    kind: str,
    name: str,
    argv: list[str],
    cwd: Path,
    *,
    restricted: bool = True,
) -> processes.Service:
    """Starts one service from argv the way its unit would, registered for teardown.

    restricted: under the units' NoNewPrivileges, MemoryDenyWriteExecute and UMask.
    """
    address = (
        cluster.config.gateway(name).address
        if kind == "gateway"
        else getattr(cluster.config.node(name), f"{kind}_address")
    )
    log_path = cluster.run_dir / "logs" / f"{kind}-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            under_unit_restrictions(argv, 0o027) if restricted else argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
    service = processes.Service(kind, name, address, process, log_path)
    cluster.services[(kind, name)] = service
    return service


def run_all(argvs: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Runs commands side by side (each is a Python start-up), returns their results."""
    running = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        for argv in argvs
    ]
    results = []
    for argv, process in zip(argvs, running, strict=True):
        try:
            out, err = process.communicate(timeout=60)
        finally:
            process.kill()
        results.append(subprocess.CompletedProcess(argv, process.returncode, out, err))
    return results


@pytest.mark.skipif(not _mdwe_supported(), reason="the kernel has no PR_SET_MDWE")
@pytest.mark.parametrize("source", sorted(COMMANDS))
def test_the_deploy_command_lines_run_a_cluster_under_the_units_restrictions(
    cluster_factory: Callable[..., LocalCluster], source: str
) -> None:
    cluster = cluster_factory(TEMPLATES[source])
    command = COMMANDS[source]
    services = []
    for node in cluster.config.nodes:
        # StateDirectory= makes the data directory; WorkingDirectory= runs in it.
        node.data_dir.mkdir(parents=True, exist_ok=True)
        for kind in ("replica", "coordinator"):
            argv = command(kind, node.id, cluster.config_path)
            services.append(launch(cluster, kind, node.id, argv, node.data_dir))
    for gateway in cluster.config.gateways:
        argv = command("gateway", gateway.id, cluster.config_path)
        services.append(launch(cluster, "gateway", gateway.id, argv, Path("/")))
    # Started side by side, as systemd and compose do; each waited for in turn.
    processes.wait_serving(services)
    master = cluster.wait_for_master()
    assert master == max(cluster.config.nodes, key=lambda n: n.priority).id
    for service in cluster.services.values():
        status = Path(f"/proc/{service.pid}/status").read_text()
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.M), service.name

    with squall.connect(cluster.gateway_address) as client:
        client.create_topic("deploy")
        topic = client.topic("deploy")
        with topic.publisher("p") as publisher:
            receipts = publisher.publish_many([b"e%d" % i for i in range(50)])
        assert [r.offset for r in receipts] == list(range(50))
        with topic.subscribe(start="earliest", follow=False) as subscription:
            assert [m.payload for m in subscription] == [b"e%d" % i for i in range(50)]

    # UMask=0027: the store is not readable by other users.
    store_file = cluster.config.node(master).data_dir / "data.mdb"
    assert stat.S_IMODE(store_file.stat().st_mode) & 0o007 == 0, oct(store_file.stat().st_mode)


@pytest.mark.parametrize("source", sorted(COMMANDS))
def test_a_broken_config_exits_with_the_status_the_units_do_not_restart_on(
    tmp_path: Path, source: str
) -> None:
    prevented = {
        int(one(parse_unit(SYSTEMD / unit), "Service", "RestartPreventExitStatus"))
        for unit in SERVICE_UNITS.values()
    }
    assert prevented == {2}
    broken = tmp_path / "cluster.toml"
    broken.write_text(
        (Path(__file__).resolve().parents[2] / "deploy" / TEMPLATES[source])
        .read_text()
        .replace("priority = 2", "priority = -2", 1)
    )
    command = COMMANDS[source]
    cases = [
        (command(kind, instance, broken), "priority = -2")
        for kind, instance in (("replica", "n1"), ("coordinator", "n1"), ("gateway", "g1"))
    ]
    if source == "systemd":
        # A unit instance the file does not name (squall-replica@n9) is a config error
        # too, and so is an EnvironmentFile pointing at a config that is not there.
        valid = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.toml"
        cases += [
            (unit_command("replica", "n9", valid), "n9"),
            (unit_command("coordinator", "n1", tmp_path / "missing.toml"), "missing.toml"),
        ]
    results = run_all([argv for argv, _ in cases], tmp_path)
    for (argv, named), result in zip(cases, results, strict=True):
        assert result.returncode == 2, (argv, result.stderr)
        assert named.split(" = ")[-1] in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _syscall_group(name: str) -> set[str]:
    """The system calls a systemd filter group allows, as this systemd defines it."""
    listing = subprocess.run(
        ["systemd-analyze", "syscall-filter", name],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    calls: set[str] = set()
    for line in listing[1:]:
        entry = line.strip()
        if entry.startswith("@"):
            calls |= _syscall_group(entry)
        elif entry and not entry.startswith("#"):
            calls.add(entry)
    return calls


def _unit_syscall_filter(kind: str) -> set[str]:
    """What the unit's SystemCallFilter= lines allow: allow lists, minus ~ deny lists."""
    allowed: set[str] = set()
    denied: set[str] = set()
    for value in parse_unit(SYSTEMD / SERVICE_UNITS[kind])["Service"]["SystemCallFilter"]:
        target = denied if value.startswith("~") else allowed
        for name in value.lstrip("~").split():
            target |= _syscall_group(name) if name.startswith("@") else {name}
    return allowed - denied


def _tracee(strace: processes.Service, trace: Path) -> int:
    """The pid of the service strace started: the one whose execve opens the trace.

    (Not strace's first child: strace forks short-lived children of its own at start-up
    to probe what ptrace can do.)
    """
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        first = trace.read_text().split("\n", 1)[0] if trace.exists() else ""
        if match := re.match(r"(\d+)\s+execve\(", first):
            return int(match.group(1))
        if strace.process.poll() is not None:
            raise RuntimeError(f"strace exited with {strace.process.returncode}")
        time.sleep(0.02)
    raise TimeoutError(f"strace {strace.pid} started no service")


def _stop_traced(strace: processes.Service, tracee: int) -> None:
    """Stops a traced service by its own pid: SIGTERM to strace would only detach it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(tracee, signal.SIGTERM)
    try:
        strace.process.wait(30)  # strace exits once its tracee has
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(tracee, signal.SIGKILL)
        strace.process.kill()
        strace.process.wait(30)


@pytest.mark.skipif(
    shutil.which("strace") is None or shutil.which("systemd-analyze") is None,
    reason="needs strace and systemd-analyze",
)
def test_every_system_call_the_services_make_passes_the_units_filter(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = cluster_factory("single.toml")
    node, gateway = cluster.config.nodes[0], cluster.config.gateways[0]
    traces: dict[str, Path] = {}
    traced: list[tuple[processes.Service, int]] = []
    try:
        for kind, name in (("replica", node.id), ("coordinator", node.id), ("gateway", gateway.id)):
            traces[kind] = cluster.run_dir / f"{kind}.strace"
            argv = ["strace", "-f", "-qq", "-o", str(traces[kind])]
            argv += unit_command(kind, name, cluster.config_path)
            strace = launch(cluster, kind, name, argv, cluster.run_dir, restricted=False)
            traced.append((strace, _tracee(strace, traces[kind])))
        processes.wait_serving([strace for strace, _ in traced], timeout_s=120)
        cluster.wait_for_master(timeout_s=60)
        with squall.connect(cluster.gateway_address) as client:
            client.create_topic("traced")
            topic = client.topic("traced")
            with topic.publisher("p") as publisher:
                publisher.publish_many([b"x" * 100] * 500, batch_events=100)
            with topic.subscribe(start="earliest", follow=False) as subscription:
                assert sum(1 for _ in subscription) == 500
    finally:
        # SIGTERM to each service itself, so its stop path is traced too.
        for strace, tracee in traced:
            _stop_traced(strace, tracee)
    for kind, trace in traces.items():
        made = set(re.findall(r"^\d+\s+(\w+)\(", trace.read_text(), re.M))
        assert {"bind", "fsync", "epoll_wait"} & made, f"{kind}: no trace?"
        refused = sorted(made - _unit_syscall_filter(kind))
        assert refused == [], f"{kind} makes system calls its unit refuses: {refused}"
