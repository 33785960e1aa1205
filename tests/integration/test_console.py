"""The web console in a real browser (issue 21 item 4): a three-node cluster, its gateway and
`squall console` as real processes, the page in headless Chromium over the DevTools pipe.

One test, in the order a person would go: the token-protected console refuses a request
without its token and lets the browser log in; the replica table shows the master; an
event published by an app, and one published from the page, appear in the topic view; a
topic name that does not parse gets a clear message; killing the master's node (kill -9)
moves the page to the new master within the failover bound, without a reload; a
transfer confirmed in the page's dialog moves the master and shows in the audit trail;
the gateway's own console ([console]) refuses a request without the token.
Screenshots after each step go to test-artifacts/console/ (gitignored).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import squall
from tests.chromium import Browser, chromium_missing
from tests.integration.conftest import ROOT, LocalCluster

ARTIFACTS = ROOT / "test-artifacts" / "console"
TOKEN = "console-test-token-0123456789"
# The failover itself takes under a second on a quiet machine (bench/README.md); the page
# adds one poll (500 ms here) and the event stream. Generous: the machine is shared.
FAILOVER_BOUND_S = 15.0
# Seconds the console may take to start and print its address.
CONSOLE_START_S = 30.0


@pytest.fixture
def console(cluster_factory: object, tmp_path: Path) -> Iterator[tuple[LocalCluster, str]]:
    """A running three-node cluster and a token-protected console for it (its base URL)."""
    reason = chromium_missing()
    if reason:
        pytest.skip(reason)
    token_file = tmp_path / "console.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    # The gateway serves a console of its own too ([console]), with the same token.
    cluster = cluster_factory(  # type: ignore[operator]
        "cluster.example.toml",
        console={"enabled": True, "token_file": str(token_file), "poll_interval_ms": 500},
    )
    assert isinstance(cluster, LocalCluster)
    log_path = tmp_path / "console.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "squall_server", "console",
                "--config", str(cluster.config_path), "--listen", "127.0.0.1:0",
                "--poll-ms", "500", "--token-file", str(token_file),
            ],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=ROOT, start_new_session=True,
        )  # fmt: skip
    try:
        # The console starts while the cluster does (it polls until the gateway answers).
        cluster.start_all()
        deadline = time.monotonic() + CONSOLE_START_S
        match = None
        while match is None:
            assert process.poll() is None, f"console exited: {log_path.read_text()}"
            assert time.monotonic() < deadline, f"console did not start: {log_path.read_text()}"
            match = re.search(r"serving (http://\S+/)", log_path.read_text())
            time.sleep(0.05)
        yield cluster, match[1].rstrip("/")
    finally:
        # SIGTERM to the console and every service at once, so they stop side by side;
        # the cluster fixture's finalizer then reaps each by PID (killing what lingers).
        for service in cluster.services.values():
            if service.process.poll() is None:
                service.process.terminate()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


def _master_text(browser: Browser) -> str:
    return str(browser.evaluate("document.getElementById('master').textContent"))


def test_console_in_a_browser(console: tuple[LocalCluster, str]) -> None:
    cluster, base = console
    shots = ARTIFACTS
    # 1. The token: a request without it is refused, with it answered.
    assert _status(f"{base}/api/snapshot") == 401
    assert _status(f"{base}/api/snapshot", "wrong-token") == 401
    assert _status(f"{base}/api/snapshot", TOKEN) == 200
    master = cluster.wait_for_master()
    with squall.connect(cluster.gateway_address, timeout_s=10) as client:
        client.create_topic("console-demo")
        with client.topic("console-demo").publisher("console-test-app") as publisher:
            publisher.publish(b"from an app", headers={"origin": "test"})

    with Browser() as browser:
        browser.goto(f"{base}/")  # redirected to the login form
        assert browser.evaluate("location.pathname") == "/login"
        browser.screenshot(shots / "1-login.png")
        browser.evaluate(
            f"document.getElementById('token').value = {TOKEN!r};"
            "document.getElementById('login-form').submit(); true"
        )
        # 2. The replica table shows the master, marked, with all three nodes.
        browser.wait_for(
            f"location.pathname === '/' && document.getElementById('master')"
            f" && document.getElementById('master').textContent === {master!r}",
            FAILOVER_BOUND_S,
        )
        browser.wait_for(
            "document.querySelectorAll('#replicas tbody tr').length === 3"
            f" && document.querySelector('#replicas tr.master').dataset.node === {master!r}",
            FAILOVER_BOUND_S,
        )
        browser.screenshot(shots / "2-replicas.png")

        # 3. The topic view shows the app's event; one published from the page follows.
        browser.evaluate(
            "document.getElementById('topic-name').value = 'console-demo';"
            "document.getElementById('topic-read').click(); true"
        )
        browser.wait_for(
            "[...document.querySelectorAll('#events tbody tr')].some(r =>"
            " r.textContent.includes('from an app') && r.textContent.includes('origin=test')"
            " && r.textContent.includes('console-test-app'))",
            FAILOVER_BOUND_S,
        )
        browser.evaluate(
            "document.getElementById('pub-payload').value = 'hello from the page';"
            "document.getElementById('pub-send').click(); true"
        )
        browser.wait_for(
            "document.getElementById('publish-message').textContent.includes('at offset 1')"
            " && [...document.querySelectorAll('#events tbody tr')].some(r =>"
            " r.dataset.offset === '1' && r.textContent.includes('hello from the page'))",
            FAILOVER_BOUND_S,
        )
        browser.screenshot(shots / "3-topic-view.png")
        # The event is in the cluster, not only on the page.
        with squall.connect(cluster.gateway_address, timeout_s=10) as client:
            with client.topic("console-demo").subscribe(None, follow=False) as sub:
                assert [m.payload for m in sub] == [b"from an app", b"hello from the page"]

        # 4. A topic name that does not parse: a clear message, no events shown.
        browser.evaluate(
            "document.getElementById('topic-name').value = 'no spaces allowed';"
            "document.getElementById('topic-read').click(); true"
        )
        browser.wait_for(
            "document.getElementById('topic-message').textContent.includes("
            "\"invalid topic name 'no spaces allowed'\")"
            " && document.querySelectorAll('#events tbody tr').length === 0",
            FAILOVER_BOUND_S,
        )

        # 5. kill -9 the master's node: the page follows the failover without a reload.
        browser.evaluate("window.__notReloaded = true")
        killed_at = time.monotonic()
        cluster.kill_node(master)
        new_master = browser.wait_for(
            f"(t => t !== {master!r} && t !== 'none' && t !== '?' && t)"
            "(document.getElementById('master').textContent)",
            FAILOVER_BOUND_S,
        )
        seen_after_s = time.monotonic() - killed_at
        assert browser.evaluate("window.__notReloaded === true")
        browser.wait_for(
            f"document.querySelector('#replicas tr.master').dataset.node === {new_master!r}"
            f" && [...document.querySelectorAll('#timeline li')].some(li =>"
            f" li.textContent.includes({new_master + ' is master'!r}))",
            FAILOVER_BOUND_S,
        )
        browser.screenshot(shots / "4-after-failover.png")
        print(f"console showed master {new_master} {seen_after_s:.2f}s after {master} was killed")

        # 6. An operator action from the page: transfer to the last node, confirmed in the
        # dialog; it goes through `squall cluster transfer` and lands in the audit trail.
        target = next(n.id for n in cluster.config.nodes if n.id not in (master, new_master))
        browser.evaluate(
            f'document.querySelector(\'#replicas tr[data-node="{target}"]'
            " button[data-action=transfer]').click();"
            "document.getElementById('confirm-reason').value = 'browser test';"
            f"document.getElementById('confirm-node').value = {target!r};"
            "document.getElementById('confirm-go').click(); true"
        )
        browser.wait_for(
            f"document.getElementById('action-message').textContent.includes('{target} leads')"
            f" && document.getElementById('master').textContent === {target!r}"
            " && [...document.querySelectorAll('#timeline li.operator')].some(li =>"
            f" li.textContent.includes('transfer to {target}: console: browser test'))",
            FAILOVER_BOUND_S,
        )
        browser.screenshot(shots / "5-after-transfer.png")
        new_master = target

    # 7. The gateway's own console ([console]) answers with the same token and sees the
    # same cluster; without the token it refuses.
    hosted = f"http://{cluster.config.console.address}"
    assert _status(f"{hosted}/api/snapshot") == 401
    request = urllib.request.Request(f"{hosted}/api/snapshot")
    request.add_header("Authorization", f"Bearer {TOKEN}")
    deadline = time.monotonic() + FAILOVER_BOUND_S
    while True:
        with urllib.request.urlopen(request, timeout=10) as response:
            snapshot = json.loads(response.read())
        if snapshot.get("master_id") == new_master or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert snapshot["master_id"] == new_master, snapshot.get("error")
