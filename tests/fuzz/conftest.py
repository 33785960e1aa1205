"""Hypothesis profiles for the fuzz tests (docs/fuzzing.md).

``ci`` (the default): few examples per property, derandomized so a failure reproduces on
every run and machine, and the whole fuzz set takes about a minute on two cores.
``deep``: many more examples, random (a new search each run; hypothesis prints the
``@reproduce_failure`` blob and keeps failing examples in .hypothesis/ to replay them).
Pick one with ``HYPOTHESIS_PROFILE=deep``; ``FUZZ_EXAMPLES=N`` overrides the count.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "12")),
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "deep",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "1000")),
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter: object) -> None:
    """With FUZZ_STATS=1: how the fuzzed calls ended, per method and status."""
    if not os.environ.get("FUZZ_STATS"):
        return
    from tests.fuzz.test_fuzz_requests import STATS

    write = terminalreporter.write_line  # type: ignore[attr-defined]
    write("fuzzed calls by method and status:")
    for (method, code), count in sorted(STATS.items()):
        write(f"  {method:45} {code:20} {count}")
