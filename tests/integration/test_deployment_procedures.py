"""The VM guide's procedures (docs/deployment.md), run on real processes as written there.

Goal: what an operator relies on when following the guide — a backup taken from a live
store while publishers run holds every event acknowledged before it began, restores into
a node whose disk was lost, and that node rejoins and ends equal to the others; a rolling
restart (slaves first, then the master; `squall status --wait-normal` between steps)
loses no acknowledged event and leaves every store equal; and so does a rolling upgrade,
where each node and then the gateway comes back from a new release installed the way the
guide and the container image install it (a wheel built from freshly generated code, in
its own virtual environment, run from outside the source tree).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import squall
from deploy import processes
from squall.v1 import common_pb2
from squall_server.replica.store import DATABASES, Store
from squall_server.replica.store.kv_lmdb import LmdbKV
from tests.integration.conftest import ROOT, LocalCluster, make_cluster, wait_for
from tests.integration.test_deploy_commands import launch
from tests.unit.test_deploy_files import dockerfile_stages

pytestmark = pytest.mark.integration

TOPIC = "orders"


def squall_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs the `squall` command as an operator would (its own process)."""
    return subprocess.run(
        [sys.executable, "-m", "squall_server", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class PublisherThread(threading.Thread):
    """Publishes numbered events through the gateway with the client library, as an app
    following the docs does.

    The library retries a publish whose outcome is unknown with the same publisher id and
    sequences, within its retry budget; when that runs out (`Indeterminate`, e.g. while
    the group re-forms on a machine too loaded to keep its heartbeats), the thread
    publishes the same events again under the same sequences, which the master
    deduplicates, for up to UNKNOWN_OUTCOME_S. Any other error, or an outage longer than
    that, is kept and fails the test.
    """

    UNKNOWN_OUTCOME_S = 30.0

    def __init__(self, gateway: str, publisher_id: str) -> None:
        super().__init__(daemon=True, name=f"publisher-{publisher_id}")
        self.gateway = gateway
        self.publisher_id = publisher_id
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.unknown_outcomes = 0
        self._acked: dict[bytes, int] = {}  # payload -> offset
        self._lock = threading.Lock()

    def acked(self) -> dict[bytes, int]:
        """Every event acknowledged so far, payload -> offset."""
        with self._lock:
            return dict(self._acked)

    def count(self) -> int:
        """How many events were acknowledged so far."""
        with self._lock:
            return len(self._acked)

    def run(self) -> None:
        try:
            with squall.connect(self.gateway, timeout_s=10) as client:
                self._publish(client.topic(TOPIC))
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _publish(self, topic: squall.Topic) -> None:
        sequence = 1
        publisher = topic.publisher(self.publisher_id)
        try:
            # Bounded: the test stops it well before this many batches.
            for batch in range(20_000):
                if self.stop.is_set():
                    return
                payloads = [f"{self.publisher_id}-{batch}-{i}".encode() for i in range(5)]
                unknown_since = 0.0
                while True:
                    try:
                        receipts = publisher.publish_many(payloads)
                        break
                    except squall.Indeterminate:
                        self.unknown_outcomes += 1
                        now = time.monotonic()
                        unknown_since = unknown_since or now
                        if now - unknown_since > self.UNKNOWN_OUTCOME_S:
                            raise
                        with contextlib.suppress(squall.SquallError):
                            publisher.close()  # its outcome is the one just reported
                        publisher = topic.publisher(self.publisher_id, start_sequence=sequence)
                sequence += len(payloads)
                with self._lock:
                    for payload, receipt in zip(payloads, receipts, strict=True):
                        self._acked[payload] = receipt.offset
        finally:
            with contextlib.suppress(squall.SquallError):
                publisher.close()


def total_acked(publishers: list[PublisherThread]) -> int:
    """Events acknowledged so far; a publisher that gave up fails the test at once."""
    for publisher in publishers:
        assert publisher.error is None, f"{publisher.name} gave up: {publisher.error!r}"
    return sum(p.count() for p in publishers)


def all_acked(publishers: list[PublisherThread]) -> dict[int, bytes]:
    """offset -> payload of every acknowledged event (two at one offset fails the test)."""
    by_offset: dict[int, bytes] = {}
    for publisher in publishers:
        for payload, offset in publisher.acked().items():
            assert by_offset.setdefault(offset, payload) == payload, f"two events at {offset}"
    return by_offset


def read_replica(address: str) -> dict[int, bytes]:
    """Every committed event one replica serves, offset -> payload ({} if unreachable)."""
    try:
        with (
            squall.connect(address, timeout_s=10, retry_attempts_max=1) as client,
            client.topic(TOPIC).subscribe(start="earliest", follow=False) as subscription,
        ):
            return {message.offset: message.payload for message in subscription}
    except squall.SquallError:
        return {}


def read_store_copy(path: Path) -> tuple[int, dict[int, bytes]]:
    """(last LSN, offset -> payload of the topic) of a store copy no process has open."""
    store = Store(LmdbKV(path, DATABASES, map_size_bytes=0, readonly=True, lock=False))
    try:
        last_lsn = store.meta().last_lsn
        events: dict[int, bytes] = {}
        offset = 0
        # One read per batch of the topic: bounded by its length.
        while batch := store.read_events(TOPIC, offset, 1000):
            events.update((event.offset, event.payload) for event in batch)
            offset = batch[-1].offset + 1
        return last_lsn, events
    finally:
        store.close()


def stop_publishers_and_check_every_replica(
    cluster: LocalCluster, publishers: list[PublisherThread]
) -> dict[int, bytes]:
    """Stops the publishers; waits until every replica holds every acknowledged event at
    its offset and all replicas serve the same events, with no gap. Returns the events."""
    for publisher in publishers:
        publisher.stop.set()
    for publisher in publishers:
        publisher.join(timeout=60)
        assert not publisher.is_alive(), f"{publisher.name} did not stop"
        assert publisher.error is None, repr(publisher.error)
    expected = all_acked(publishers)
    views: list[dict[int, bytes]] = []

    def every_replica_holds_every_ack() -> bool:
        views[:] = [read_replica(cluster.replica_address(n.id)) for n in cluster.config.nodes]
        return all(
            all(view.get(offset) == payload for offset, payload in expected.items())
            for view in views
        ) and all(view == views[0] for view in views)

    wait_for(every_replica_holds_every_ack, 30, "every replica holds every acknowledged event")
    assert sorted(views[0]) == list(range(len(views[0]))), "a replica's offsets have a gap"
    return views[0]


@pytest.fixture
def trio(cluster_factory: object) -> LocalCluster:
    cluster = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    with squall.connect(cluster.gateway_address) as client:
        client.create_topic(TOPIC)
    return cluster


@pytest.fixture
def publishers(trio: LocalCluster) -> Iterator[list[PublisherThread]]:
    started = [PublisherThread(trio.gateway_address, f"pub{i}") for i in range(2)]
    for publisher in started:
        publisher.start()
    yield started
    for publisher in started:
        publisher.stop.set()
    for publisher in started:
        publisher.join(timeout=60)


def test_a_live_backup_restores_into_a_lost_node_that_rejoins_with_every_event(
    trio: LocalCluster, publishers: list[PublisherThread], tmp_path: Path
) -> None:
    master = trio.wait_for_master()
    wait_for(lambda: total_acked(publishers) >= 200, 20, "200 events acknowledged")
    before_backup = all_acked(publishers)
    backup_dir = tmp_path / "backup"

    # The guide's backup: the master's store, copied while publishers keep writing.
    result = squall_cli("store", "backup", str(trio.config.node(master).data_dir), str(backup_dir))
    assert result.returncode == 0, result.stderr
    assert "backed up" in result.stdout
    after = total_acked(publishers)
    wait_for(lambda: total_acked(publishers) >= after + 100, 20, "publishing went on")
    manifest = json.loads((backup_dir / "squall-backup.json").read_text())
    assert manifest["topics"] == 1 and manifest["cluster_id"]

    # The copy holds every event acknowledged before the backup began, at its offset:
    # the master holds every committed event, and the copy is one committed state of it.
    last_lsn, backed_up = read_store_copy(backup_dir)
    assert last_lsn == manifest["last_lsn"]
    missing = {o: p for o, p in before_backup.items() if backed_up.get(o) != p}
    assert not missing, f"{len(missing)} acknowledged events not in the backup"
    assert set(backed_up) == set(range(len(backed_up))), "the backup's offsets have a gap"

    # A slave's disk is lost: kill its processes, move its data directory away, restore
    # the backup into a new one and start it; it rejoins and catches up.
    lost = next(n.id for n in trio.config.nodes if n.id != master)
    lost_dir = trio.config.node(lost).data_dir
    trio.kill_node(lost)
    shutil.move(lost_dir, lost_dir.with_name(f"{lost_dir.name}.lost"))
    result = squall_cli("store", "restore", str(backup_dir), str(lost_dir))
    assert result.returncode == 0, result.stderr
    restored_lsn, restored = read_store_copy(lost_dir)
    assert restored_lsn == last_lsn and restored == backed_up
    # Restoring over a store is refused, and changes nothing.
    refused = squall_cli("store", "restore", str(backup_dir), str(lost_dir))
    assert refused.returncode == 2 and "already holds a store" in refused.stderr
    assert read_store_copy(lost_dir) == (restored_lsn, restored)

    trio.start_node(lost)
    result = squall_cli("status", "--gateway", trio.gateway_address, "--wait-normal", "60")
    assert result.returncode == 0, result.stderr
    assert trio.replica_role(lost) == common_pb2.ROLE_SLAVE
    now = total_acked(publishers)
    wait_for(lambda: total_acked(publishers) >= now + 100, 20, "publishing with the node back")
    final = stop_publishers_and_check_every_replica(trio, publishers)
    assert all(final.get(offset) == payload for offset, payload in backed_up.items())


def test_a_rolling_restart_loses_no_acknowledged_event(
    trio: LocalCluster, publishers: list[PublisherThread]
) -> None:
    first_master = trio.wait_for_master()
    wait_for(lambda: total_acked(publishers) >= 100, 20, "100 events acknowledged")
    by_priority = sorted(trio.config.nodes, key=lambda n: n.priority)
    # Slaves first (lowest priority first), the master last.
    order = [n.id for n in by_priority if n.id != first_master] + [first_master]
    for node_id in order:
        # As `systemctl restart` does: SIGTERM by PID (the coordinator first: it is
        # ordered after its replica), then start both again.
        trio.stop("coordinator", node_id)
        trio.stop("replica", node_id)
        if node_id == first_master:
            assert trio.wait_for_master(exclude=first_master) != first_master
        trio.start_node(node_id)
        result = squall_cli("status", "--gateway", trio.gateway_address, "--wait-normal", "60")
        assert result.returncode == 0, f"after restarting {node_id}: {result.stderr}"
        assert "master:" in result.stdout
        before = total_acked(publishers)
        wait_for(
            lambda before=before: total_acked(publishers) >= before + 50,  # type: ignore[misc]
            20,
            f"publishing goes on after {node_id} restarted",
        )
    # The highest-priority node leads again once it is back (and has caught up).
    wait_for(lambda: trio.wait_for_master() == first_master, 30, f"{first_master} leads again")
    stop_publishers_and_check_every_replica(trio, publishers)


def install_release(tmp_path: Path) -> Path:
    """Installs this tree as a new release the way the image's build stage does; returns
    its virtual environment.

    The build context holds only what the Dockerfile copies; the protobuf code is
    generated there, a wheel is built from it and installed into a fresh environment.
    The dependencies (grpcio, lmdb, ...) come from this environment through a .pth file
    rather than from the package index: the release under test is Squall's own code.
    """
    context = tmp_path / "context"
    _, build = dockerfile_stages()[0]
    for line in build:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                target = context / source
                target.parent.mkdir(parents=True, exist_ok=True)
                if (ROOT / source).is_dir():
                    shutil.copytree(
                        ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    shutil.copy(ROOT / source, target)
    shutil.rmtree(context / "clients" / "squall" / "v1")  # generated below, as in the image
    steps = [
        ([sys.executable, "scripts/gen_protos.py"], context),
        (
            [
                *(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"),
                *("--no-build-isolation", "-w", str(tmp_path / "dist")),
                *(str(context / "clients"), str(context)),
            ],
            context,
        ),
        ([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "release")], tmp_path),
    ]
    for argv, cwd in steps:
        result = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
        )
        assert result.returncode == 0, f"{argv}: {result.stdout}{result.stderr}"
    release = tmp_path / "release"
    python = release / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    Path(purelib, "squall-test-dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    wheels = sorted(str(wheel) for wheel in (tmp_path / "dist").glob("squall*.whl"))
    assert len(wheels) == 2, wheels  # the client and the server
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install", "-q"),
            *("--no-deps", "--no-index", *wheels),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    where = subprocess.run(
        [str(python), "-c", "import squall_server, squall.v1; print(squall_server.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert where.startswith(purelib), f"the release runs code from {where}"
    return release


@pytest.fixture
def trio_two_gateways(tmp_path: Path) -> Iterator[LocalCluster]:
    """Three nodes and two gateways, as the guide recommends for rolling upgrades."""
    document = tomllib.loads((ROOT / "deploy" / "cluster.example.toml").read_text())
    document["gateways"].append({"id": "g2", "address": "127.0.0.1:7110"})
    template = tmp_path / "two-gateways.toml"
    template.write_text(processes.dump_toml(document))
    cluster = make_cluster(template, tmp_path / "cluster")
    try:
        cluster.start_all()
        with squall.connect(cluster.gateway_address) as client:
            client.create_topic(TOPIC)
        yield cluster
    finally:
        cluster.stop_all()


def test_a_rolling_upgrade_to_a_new_release_loses_no_acknowledged_event(
    trio_two_gateways: LocalCluster, tmp_path: Path
) -> None:
    trio = trio_two_gateways
    release = install_release(tmp_path / "release")
    squall_release = str(release / "bin" / "squall")
    # Apps list both gateways (gRPC's "ipv4:" target with several addresses): while one
    # restarts, the channel connects to the other.
    gateways = "ipv4:" + ",".join(g.address for g in trio.config.gateways)
    publishers = [PublisherThread(gateways, f"pub{i}") for i in range(2)]
    for publisher in publishers:
        publisher.start()
    try:
        upgrade_every_service(trio, publishers, squall_release, tmp_path)
        # Every service now runs the new release.
        for (kind, name), service in trio.services.items():
            command = Path(f"/proc/{service.pid}/cmdline").read_bytes().split(b"\0")
            assert command[1].decode() == squall_release, (kind, name, command)
        stop_publishers_and_check_every_replica(trio, publishers)
    finally:
        for publisher in publishers:
            publisher.stop.set()
        for publisher in publishers:
            publisher.join(timeout=60)


def upgrade_every_service(
    trio: LocalCluster, publishers: list[PublisherThread], squall_release: str, cwd: Path
) -> None:
    """The guide's rolling upgrade: slaves, then the master, then each gateway; after each
    step `squall status --wait-normal` (from the new release) and publishing goes on."""
    first_master = trio.wait_for_master()
    wait_for(lambda: total_acked(publishers) >= 100, 20, "100 events acknowledged")
    config = str(trio.config_path)
    nodes = sorted(trio.config.nodes, key=lambda n: n.priority)
    order = [n.id for n in nodes if n.id != first_master] + [first_master]

    def wait_normal_and_progress(step: str) -> None:
        result = subprocess.run(
            [squall_release, "status", "--gateway", trio.gateway_address, "--wait-normal", "60"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=cwd,
        )
        assert result.returncode == 0, f"after {step}: {result.stderr}"
        before = total_acked(publishers)
        wait_for(lambda: total_acked(publishers) >= before + 50, 20, f"publishing after {step}")

    for node_id in order:
        trio.stop("coordinator", node_id)
        trio.stop("replica", node_id)
        data_dir = trio.config.node(node_id).data_dir
        started = [
            launch(
                trio,
                kind,
                node_id,
                [squall_release, kind, "--config", config, "--node", node_id],
                data_dir,
                restricted=False,
            )
            for kind in ("replica", "coordinator")
        ]
        processes.wait_serving(started)
        wait_normal_and_progress(f"upgrading {node_id}")
    wait_for(lambda: trio.wait_for_master() == first_master, 30, f"{first_master} leads again")
    for gateway in trio.config.gateways:
        trio.stop("gateway", gateway.id)
        argv = [squall_release, "gateway", "--config", config, "--gateway", gateway.id]
        service = launch(trio, "gateway", gateway.id, argv, Path("/"), restricted=False)
        processes.wait_serving([service])
        wait_normal_and_progress(f"upgrading gateway {gateway.id}")


def test_the_whole_cluster_restored_from_one_backup_serves_every_event_up_to_it(
    trio: LocalCluster, publishers: list[PublisherThread], tmp_path: Path
) -> None:
    master = trio.wait_for_master()
    wait_for(lambda: total_acked(publishers) >= 200, 20, "200 events acknowledged")
    before_backup = all_acked(publishers)
    backup_dir = tmp_path / "backup"
    result = squall_cli("store", "backup", str(trio.config.node(master).data_dir), str(backup_dir))
    assert result.returncode == 0, result.stderr
    for publisher in publishers:
        publisher.stop.set()
        publisher.join(timeout=60)
    # The cluster lives on past the backup: a failover and the master's return take its
    # epochs above those the restored nodes start again from. The gateway, which lives
    # through the disaster, must follow the restored cluster all the same.
    trio.kill_node(master)
    trio.wait_for_master(exclude=master)
    trio.start_node(master)
    wait_for(lambda: trio.wait_for_master() == master, 30, f"{master} leads again")
    epoch_before = max(status.epoch for status in trio.statuses().values())
    # Every VM lost: every process killed, every data directory gone.
    for node in trio.config.nodes:
        trio.kill_node(node.id)
        shutil.rmtree(node.data_dir)
    for node in trio.config.nodes:
        result = squall_cli("store", "restore", str(backup_dir), str(node.data_dir))
        assert result.returncode == 0, result.stderr
        # A live store's copy is dirty; an all-dirty cluster refuses to start.
        result = squall_cli("store", "mark-clean", str(node.data_dir), "--shutdown-id", "restore-1")
        assert result.returncode == 0, result.stderr
    for node in trio.config.nodes:
        trio.start_node(node.id)
    result = squall_cli("status", "--gateway", trio.gateway_address, "--wait-normal", "60")
    assert result.returncode == 0, result.stderr
    epoch_after = max(status.epoch for status in trio.statuses().values())
    assert epoch_after < epoch_before, (epoch_after, epoch_before)
    _, backed_up = read_store_copy(backup_dir)
    # The copy holds the master's last batches, which no slave had acknowledged yet:
    # the new master commits them with its epoch-start entry, and a slave serves them
    # once the next heartbeat tells it that commit (normal allows a slave to lag).
    served: dict[str, dict[int, bytes]] = {}

    def every_node_serves_the_backup() -> bool:
        for node in trio.config.nodes:
            served[node.id] = read_replica(trio.replica_address(node.id))
        return all(view == backed_up for view in served.values())

    wait_for(every_node_serves_the_backup, 30, "every node serves every event of the backup")
    missing = {o for o, p in before_backup.items() if backed_up.get(o) != p}
    assert not missing, f"{len(missing)} events acknowledged before the backup are missing"
    # And the restored cluster takes new writes after them.
    with squall.connect(trio.gateway_address) as client:
        receipt = client.topic(TOPIC).publisher("after-restore").publish(b"new")
    assert receipt.offset == len(backed_up)
