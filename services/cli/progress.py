"""A progress line for long operator commands (`squall store backup|restore|verify`).

Each phase (copy, verify, restore) shows what is done of what, the rate and the time
left, on stderr so stdout keeps the one result line scripts read:

    copy: 412.0 MiB of 1.2 GiB (33%), 180.3 MiB/s, ETA 4s

On a terminal the line is rewritten in place a few times a second. Into a file or a
pipe (a cron job's log) a line is written every LOG_INTERVAL_S, and a phase that wrote
one ends with its `done in` line; a phase shorter than that writes nothing, so a log
shows the rate of long operations without filling up with short ones.
"""

from __future__ import annotations

from typing import TextIO

from squall_server.common.clock import SYSTEM_CLOCK, Clock

# Between two rewrites of the line on a terminal, and two lines in a log.
TTY_INTERVAL_S = 0.25
LOG_INTERVAL_S = 10.0
# Phases whose counts are bytes (the rest count log entries).
BYTE_PHASES = frozenset({"copy", "restore"})


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLine:
    """A `progress(phase, done, total)` callback that prints the line (see module doc)."""

    def __init__(
        self,
        out: TextIO,
        clock: Clock = SYSTEM_CLOCK,
        tty: bool | None = None,
    ) -> None:
        self._out = out
        self._clock = clock
        self._tty = out.isatty() if tty is None else tty
        self._phase = ""
        self._started = 0.0
        self._last_print = 0.0
        self._last_text = ""
        self._shown = False  # anything printed in this phase yet

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = self._clock.monotonic_ms() / 1000
        if phase != self._phase:
            self.finish()
            self._phase, self._started, self._last_print = phase, now, now
        finished = total > 0 and done >= total
        interval = TTY_INTERVAL_S if self._tty else LOG_INTERVAL_S
        if finished:
            if not self._tty and not self._shown:
                return  # a short phase: nothing in a log
        elif now - self._last_print < interval:
            return
        self._last_print = now
        self._shown = True
        self._last_text = self.format(phase, done, total, now - self._started)
        if self._tty:
            self._out.write("\r\x1b[K" + self._last_text)
        else:
            self._out.write(self._last_text + "\n")
        self._out.flush()

    def finish(self) -> None:
        """Ends the current phase's line (a newline after a terminal's rewritten line)."""
        if self._tty and self._last_text:
            self._out.write("\n")
            self._out.flush()
        self._last_text = ""
        self._shown = False

    @staticmethod
    def format(phase: str, done: int, total: int, elapsed_s: float) -> str:
        """`phase: done of total (pct), rate, ETA t` (or `done in t` once finished)."""
        show = _bytes if phase in BYTE_PHASES else (lambda n: f"{n:,.0f} entries")
        rate = done / elapsed_s if elapsed_s > 0 else 0.0
        text = f"{phase}: {show(done)} of {show(total)}"
        if total > 0:
            text += f" ({100 * done // total}%)"
        text += f", {show(rate)}/s" if rate > 0 else ""
        if total > 0 and done >= total:
            return text + f", done in {_duration(elapsed_s)}"
        if rate > 0:
            return text + f", ETA {_duration((total - done) / rate)}"
        return text + ", ETA unknown"
