"""The services' gRPC I/O path (services/__init__.py): set before gRPC is first imported,
unless the operator chose one; an app importing the client library keeps gRPC's own."""

from __future__ import annotations

import os
import subprocess
import sys

from squall_server import GRPC_EXPERIMENTS_DEFAULT

_PROBE = (
    "import sys, os, {first}; "
    "print(os.environ.get('GRPC_EXPERIMENTS', '')); print('grpc' in sys.modules)"
)


def _run(first: str, env_value: str | None = None) -> tuple[str, bool]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if env_value is not None:
        env["GRPC_EXPERIMENTS"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(first=first)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split("\n")
    return out[0], out[1] == "True"


def test_a_service_process_sets_the_io_path_before_grpc_is_imported() -> None:
    assert _run("squall_server") == (GRPC_EXPERIMENTS_DEFAULT, False)
    # Every service's entry module is inside the package: its __init__ runs first.
    assert _run("squall_server.replica.__main__")[0] == GRPC_EXPERIMENTS_DEFAULT


def test_an_operators_own_setting_wins() -> None:
    assert _run("squall_server", "-event_engine_client") == ("-event_engine_client", False)


def test_an_app_using_the_client_library_keeps_grpcs_defaults() -> None:
    # The library's names load on first use (squall/__init__.py): the app's first call.
    assert _run("squall; squall.connect") == ("", True)
