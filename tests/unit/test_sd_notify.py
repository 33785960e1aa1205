"""services/common/sd_notify.py: the datagram systemd reads, abstract socket names, and
that no socket or a dead one never stops a service."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from squall_server.common import sd_notify


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify.ready("serving") is False


def test_ready_reaches_an_abstract_socket_as_one_datagram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"squall-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify.ready("serving on 127.0.0.1:1") is True
        lines = sock.recv(4096).decode().splitlines()
    assert lines == ["READY=1", "STATUS=serving on 127.0.0.1:1", f"MAINPID={os.getpid()}"]


def test_a_socket_nobody_listens_on_is_a_warning_not_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sd_notify.stopping("stopping") is False
    assert "cannot notify systemd" in caplog.text
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert sd_notify.notify("READY=1") is False
