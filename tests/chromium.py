"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`),
for the console's browser test: no WebDriver, no websocket client, no extra package.

Chromium reads JSON commands, each ended by a NUL byte, on its file descriptor 3 and
writes answers and events the same way on 4. `Browser` starts it, opens one page, and
offers what the test needs: navigate, evaluate JavaScript, wait for a condition in the
page, take a screenshot. Everything is bounded by deadlines; `close` kills it by PID.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The flags a container needs (no sandbox without user namespaces, no GPU, /dev/shm small)
# and that keep it from reaching the network on its own.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--no-first-run",
    "--mute-audio",
    "--remote-debugging-pipe",
)
CHROMIUM_PREFIX = "needs Chromium"
# Seconds one DevTools command may take on a loaded machine.
COMMAND_TIMEOUT_S = 30.0


def chromium_binary() -> str | None:
    """The Chromium (or Chrome) on this machine, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_missing() -> str | None:
    """None when a Chromium is here, else the skip reason naming what to install."""
    if chromium_binary() is None:
        return (
            f"{CHROMIUM_PREFIX} for the console's browser test: no chromium on PATH; "
            "install it (Debian/Ubuntu: apt-get install chromium; `make test` does this as root)"
        )
    return None


class BrowserError(Exception):
    """Chromium answered a command with an error, or did not answer in time."""


class Browser:
    """One headless Chromium with one page, spoken to over the DevTools pipe."""

    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        binary = chromium_binary()
        if binary is None:
            raise BrowserError("no chromium on PATH")
        self._profile = tempfile.mkdtemp(prefix="squall-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        # DevTools reads on 3 and writes on 4: a launcher puts the pipes there and execs it.
        # Not Popen's preexec_fn: this test process runs gRPC, and a preexec_fn makes
        # Popen fork with gRPC's fork handlers, whose poller thread can abort the child
        # before its exec (grpc/grpc#43055).
        # Copies above 4 first: a pipe may already sit on 3 or 4.
        r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
        w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
                "os.closerange(5, os.sysconf('SC_OPEN_MAX')); os.execvp(sys.argv[3], sys.argv[3:])",
                str(r),
                str(w),
                binary,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(r, w),  # only these reach the launcher; ours are non-inheritable anyway
            start_new_session=True,  # its renderers share its process group: killed with it
        )
        for fd in (r, w, to_browser_r, from_browser_w):
            os.close(fd)
        self._buffer = b""
        self._next_id = 0
        self._session = ""
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
                "sessionId"
            ]
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
            self.call("Page.enable")
        except BaseException:
            self.close()
            raise

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError("chromium did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], 0.5)
            if not ready:
                if self.process.poll() is not None:
                    raise BrowserError(f"chromium exited with {self.process.returncode}")
                continue
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError("chromium closed its DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        document: dict[str, Any] = json.loads(message)
        return document

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Sends one command to the page (or the browser before a page exists); its result."""
        self._next_id += 1
        request: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self._session and not method.startswith("Target."):
            request["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        # Events in between are not needed: the test polls the page's state instead.
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") != self._next_id:
                continue
            if "error" in answer:
                raise BrowserError(f"{method}: {answer['error']}")
            result: dict[str, Any] = answer.get("result", {})
            return result

    def goto(self, url: str) -> None:
        """Opens url and waits until its document has loaded."""
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", 30)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float) -> Any:
        """Polls a JavaScript expression until it is truthy; its value. AssertionError
        naming the expression at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout_s}s in the page: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        """Saves a PNG of the whole page."""
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        """Kills Chromium by PID and removes its profile."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # our own child's group, by its id
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
