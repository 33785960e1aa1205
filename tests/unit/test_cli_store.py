"""`squall store inspect / mark-clean / mark-dirty` on real LMDB stores, and `squall cluster
shutdown` against a cluster that is not there: what an operator sees, and that a refused
command changes nothing."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from deploy import processes
from squall.v1 import common_pb2
from squall_server import cli
from squall_server.common.config import load_config
from squall_server.replica.datadir import DataDirLock
from squall_server.replica.store import Store
from tests.unit.test_store_contract import Writer, create, epoch_start, publish, set_cursor

CLUSTER = "c0ffee"


def make_store(directory: Path, *, state: int = common_pb2.STORE_STATE_DIRTY) -> Path:
    """A node's data directory holding a used store: one topic, three events, a cursor."""
    store = Store.open_lmdb(directory, 64 << 20)
    try:
        if state != common_pb2.STORE_STATE_EMPTY:
            store.set_cluster_id(CLUSTER)
            w = Writer(store, epoch=4)
            w.append(
                epoch_start(4),
                create("orders"),
                publish("orders", 0, [b"a", b"b", b"c"], publisher_id="p", sequences=[1, 2, 3]),
                set_cursor("orders", "billing", 2),
            )
            store.set_epoch(5)
            store.set_state(state, "s1" if state == common_pb2.STORE_STATE_CLEAN else "")
    finally:
        store.close()
    return directory


def squall(*argv: str) -> tuple[int, str, str]:
    """Runs the CLI in-process; returns (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = cli.main(list(argv))
    return status, out.getvalue(), err.getvalue()


def meta_of(directory: Path) -> tuple[int, str, str]:
    store = Store.open_lmdb(directory, 64 << 20)
    try:
        meta = store.meta()
        return meta.state, meta.shutdown_id, meta.cluster_id
    finally:
        store.close()


def test_inspect_shows_identity_state_position_and_counts_without_writing(
    tmp_path: Path,
) -> None:
    directory = make_store(tmp_path / "n1")
    before = (directory / "data.mdb").read_bytes()
    status, out, _ = squall("store", "inspect", str(directory))
    assert status == 0
    assert "state:       dirty" in out
    assert f"cluster id:  {CLUSTER}" in out
    assert "epoch:       5 (newest accepted)" in out
    assert "last entry:  epoch 4 LSN 4 (log holds LSNs 1..4)" in out
    assert "topics=1  events=3  subscriptions=1  publishers=1" in out
    assert "in use:      no" in out
    assert (directory / "data.mdb").read_bytes() == before

    status, out, _ = squall("store", "inspect", str(directory), "--json")
    report = json.loads(out)
    assert (report["state"], report["last_lsn"], report["last_epoch"]) == ("dirty", 4, 4)
    assert report["counts"]["events"] == 3 and report["counts"]["log_entries"] == 4


def test_inspect_reads_a_store_whose_replica_is_running(tmp_path: Path) -> None:
    directory = make_store(tmp_path / "n1", state=common_pb2.STORE_STATE_CLEAN)
    with DataDirLock(directory):
        status, out, _ = squall("store", "inspect", str(directory))
    assert status == 0
    assert "in use:      yes" in out
    assert "state:       clean (shutdown s1)" in out


def test_inspect_of_a_directory_without_a_store_fails_clearly(tmp_path: Path) -> None:
    status, _, err = squall("store", "inspect", str(tmp_path / "absent"))
    assert status == 1
    assert "no store at" in err and "data.mdb" in err
    assert not (tmp_path / "absent").exists()


def test_mark_clean_records_a_shutdown_id_and_says_what_next(tmp_path: Path) -> None:
    directory = make_store(tmp_path / "n2")
    status, out, _ = squall("store", "mark-clean", str(directory))
    assert status == 0
    state, shutdown_id, cluster_id = meta_of(directory)
    assert state == common_pb2.STORE_STATE_CLEAN and cluster_id == CLUSTER
    assert shutdown_id.startswith("manual-")
    assert f"marked clean with shutdown id {shutdown_id} (was dirty)" in out
    assert "log epoch 4 LSN 4" in out
    # The same id again changes nothing; another one replaces it.
    assert squall("store", "mark-clean", str(directory), "--shutdown-id", shutdown_id)[0] == 0
    assert meta_of(directory)[1] == shutdown_id
    assert squall("store", "mark-clean", str(directory), "--shutdown-id", "s-2")[0] == 0
    assert meta_of(directory)[1] == "s-2"


def test_mark_clean_refuses_while_the_replica_runs_and_changes_nothing(tmp_path: Path) -> None:
    directory = make_store(tmp_path / "n2")
    with DataDirLock(directory):
        status, _, err = squall("store", "mark-clean", str(directory))
    assert status == 1
    assert "is in use by process" in err and "stop that node's replica first" in err
    assert "nothing was changed" in err
    assert meta_of(directory)[0] == common_pb2.STORE_STATE_DIRTY


def test_mark_clean_refuses_an_empty_store(tmp_path: Path) -> None:
    directory = make_store(tmp_path / "n3", state=common_pb2.STORE_STATE_EMPTY)
    status, _, err = squall("store", "mark-clean", str(directory))
    assert status == 1
    assert "empty store" in err and "nothing to recover" in err
    assert meta_of(directory) == (common_pb2.STORE_STATE_EMPTY, "", "")


def test_mark_clean_refuses_a_malformed_shutdown_id(tmp_path: Path) -> None:
    directory = make_store(tmp_path / "n1")
    status, _, err = squall("store", "mark-clean", str(directory), "--shutdown-id", "a b")
    assert status == 1
    assert "shutdown id 'a b' is not" in err
    assert meta_of(directory)[0] == common_pb2.STORE_STATE_DIRTY


def test_mark_dirty_undoes_a_stale_clean_mark(tmp_path: Path) -> None:
    directory = make_store(tmp_path / "n1", state=common_pb2.STORE_STATE_CLEAN)
    status, out, _ = squall("store", "mark-dirty", str(directory))
    assert status == 0 and "marked dirty (was clean, shutdown s1)" in out
    assert meta_of(directory) == (common_pb2.STORE_STATE_DIRTY, "", CLUSTER)
    status, out, _ = squall("store", "mark-dirty", str(directory))
    assert status == 0 and "not clean (dirty); nothing to do" in out


def test_cluster_shutdown_without_a_running_cluster_changes_nothing(tmp_path: Path) -> None:
    """Every node unreachable: the command names each and says nothing was changed."""
    source = tmp_path / "cluster.toml"
    source.write_text((Path(__file__).parents[2] / "deploy" / "cluster.example.toml").read_text())
    config = processes.localize_config(source, tmp_path / "run")
    status, _, err = squall("cluster", "shutdown", "--config", str(config), "--timeout", "5")
    assert status == 1
    assert "no master is serving" in err
    assert "n1: unreachable" in err and "n3: unreachable" in err
    assert "nothing was changed" in err
    assert not (tmp_path / "run" / "data").exists()


@pytest.mark.parametrize("timeout", ["0", "-1", "3541"])
def test_cluster_shutdown_refuses_a_bad_timeout(tmp_path: Path, timeout: str) -> None:
    source = tmp_path / "cluster.toml"
    source.write_text((Path(__file__).parents[2] / "deploy" / "cluster.example.toml").read_text())
    config = processes.localize_config(source, tmp_path / "run")
    status, _, err = squall("cluster", "shutdown", "--config", str(config), "--timeout", timeout)
    assert status == 1 and "--timeout must be > 0 and at most 3540 s" in err


def test_a_localized_config_never_gives_two_services_one_port(tmp_path: Path) -> None:
    # Ports picked one at a time could repeat (a released port may be handed out again).
    source = Path(__file__).parents[2] / "deploy" / "cluster.example.toml"
    for attempt in range(20):
        config = load_config(processes.localize_config(source, tmp_path / f"run{attempt}"))
        addresses = [n.coordinator_address for n in config.nodes]
        addresses += [n.replica_address for n in config.nodes]
        addresses += [g.address for g in config.gateways]
        assert len(set(addresses)) == len(addresses)
