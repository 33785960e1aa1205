"""The latency and idle-CPU benches' own inputs and failures: a floor that could not be
measured fails the run instead of reading low, and a nonsensical option is refused."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from bench import chain_floor, idle_cpu, latency
from deploy.processes import free_port


def test_a_concurrent_floor_whose_calls_fail_raises_instead_of_reading_low() -> None:
    # Nothing listens on the port: every thread's first round trip fails.
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        with pytest.raises(RuntimeError, match="the 4-thread floor failed"):
            latency._concurrent_floor(channel, b"x" * 100, 4, 0.5)


@pytest.mark.parametrize(
    "main, argv, message",
    [
        (idle_cpu.main, ["--seconds", "0"], "must be above 0"),
        (idle_cpu.main, ["--floor", "--rate", "-3"], "must be above 0"),
        (idle_cpu.main, ["--windows", "two"], "not a number"),
        (chain_floor.main, ["--seconds", "0"], "must be above 0"),
        (chain_floor.main, ["--callers", "-1"], "must be above 0"),
        (chain_floor.main, ["--count", "many"], "not a number"),
    ],
    ids=[
        "idle-seconds",
        "idle-rate",
        "idle-windows",
        "chain-seconds",
        "chain-callers",
        "chain-count",
    ],
)
def test_a_bench_refuses_a_window_rate_or_load_that_is_not_above_zero(
    main: Callable[[list[str]], object],
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_relay_chain_of_an_unknown_shape_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="no relay chain of shape 'ring'"):
        with chain_floor.running("ring"):
            pass
