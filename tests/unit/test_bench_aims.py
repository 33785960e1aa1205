"""Issue 16's aims judged against a run's floor (bench/aims.py): the arithmetic the
report's verdicts rest on."""

from __future__ import annotations

from typing import Any

from bench import aims, latency


def _run(rtt_ms: float = 0.3, fsync_ms: float = 0.2, **scenarios: Any) -> dict[str, Any]:
    figures: dict[str, Any] = {"floor": {"stream_ms_p50": rtt_ms, "fsync_ms_p50": fsync_ms}}
    figures.update(scenarios)
    return figures


def _rate(events_per_s: float, p99_ms: float = 1.0) -> dict[str, Any]:
    return {"events_per_s": events_per_s, "latency_ms_p99": p99_ms}


def _by_aim(policy: str, figures: dict[str, Any]) -> dict[str, aims.Verdict]:
    return {v.aim.split(" >=")[0].split(" p50")[0]: v for v in aims.judge(policy, figures)}


def test_a_rate_that_reaches_the_scaled_aim_is_met() -> None:
    verdicts = _by_aim("WRITE_NO_SYNC", _run(one_at_a_time=_rate(1250)))
    assert verdicts["one at a time through the gateway"].verdict == "met"


def test_one_at_a_time_aims_below_three_round_trips_are_beyond_the_floor() -> None:
    # 1,200/s is 0.83 ms a publish where three 0.3 ms round trips take 0.9 ms.
    verdicts = _by_aim(
        "WRITE_NO_SYNC", _run(one_at_a_time=_rate(480), one_at_a_time_proxy=_rate(550))
    )
    gateway = verdicts["one at a time through the gateway"]
    assert gateway.verdict == "beyond the floor"
    assert gateway.bound.startswith("1,111/s")
    # Through a proxy: 2,000/s is 0.5 ms, two round trips 0.6 ms.
    assert verdicts["one at a time through a replicated proxy"].verdict == "beyond the floor"


def test_aims_scale_with_the_floor_of_the_run() -> None:
    # A floor twice the stated one halves a rate aim and doubles a latency aim.
    figures = _run(rtt_ms=0.6, one_at_a_time=_rate(610), delivery={"latency_ms_p50": 3.9})
    verdicts = _by_aim("WRITE_NO_SYNC", figures)
    assert verdicts["one at a time through the gateway"].scaled == "600/s"
    assert verdicts["one at a time through the gateway"].verdict == "met"
    assert verdicts["publish -> following subscriber"].scaled == "4.00 ms"
    assert verdicts["publish -> following subscriber"].verdict == "met"


def test_the_sync_aim_counts_the_flush_on_the_path() -> None:
    # 900/s is 1.11 ms: three round trips (0.9 ms) leave room for a fast flush only.
    fast_disk = _by_aim("SYNC", _run(fsync_ms=0.1, one_at_a_time=_rate(333)))
    assert fast_disk["one at a time through the gateway"].verdict == "missed"
    slow_disk = _by_aim("SYNC", _run(fsync_ms=0.3, one_at_a_time=_rate(333)))
    assert slow_disk["one at a time through the gateway"].verdict == "beyond the floor"
    assert "fsync 0.30 ms" in slow_disk["one at a time through the gateway"].bound


def test_a_delivery_above_the_aim_but_within_the_floor_is_missed() -> None:
    verdicts = _by_aim(
        "WRITE_NO_SYNC",
        _run(delivery={"latency_ms_p50": 2.5}, push_delivery={"latency_ms_p50": 1.9}),
    )
    assert verdicts["publish -> following subscriber"].verdict == "missed"
    assert verdicts["publish -> following subscriber"].bound.startswith("0.90 ms")
    assert verdicts["publish -> push endpoint"].verdict == "met"
    assert verdicts["publish -> push endpoint"].bound.startswith("0.75 ms")


def test_the_64_publisher_aim_needs_both_its_rate_and_its_p99_and_names_the_best_path() -> None:
    bare = {"64": {"calls_per_s": 3800, "latency_ms_p50": 16.0, "latency_ms_p99": 24.0}}
    figures = _run(
        concurrent={"64": _rate(3900, 20.0)},
        concurrent_shared={"64": _rate(26000, 12.0)},
    )
    figures["floor"]["concurrent"] = bare
    verdict = _by_aim("WRITE_NO_SYNC", figures)["64 concurrent publishers"]
    assert verdict.verdict == "missed"  # the rate is met, the p99 (10 ms) is not
    assert "one shared publisher" in verdict.measured
    assert "3,800/s" in verdict.bound
    figures["concurrent_shared"]["64"] = _rate(26000, 9.0)
    assert _by_aim("WRITE_NO_SYNC", figures)["64 concurrent publishers"].verdict == "met"


def test_the_64_publisher_aim_shows_what_its_cpu_per_event_allows_on_the_cores() -> None:
    best = _rate(4000, 12.0)
    # 40 % + 10 % + 60 % + 2 x 30 % of a core at 4,000 events/s: 425 µs per event; the
    # coordinators and the bench's other threads ("others") are not the path's work.
    best["cpu_pct"] = {
        "client": 40.0,
        "gateway-g1": 10.0,
        "replica-n1": 60.0,
        "replica-n2": 30.0,
        "replica-n3": 30.0,
        "others": 50.0,
    }
    figures = _run(concurrent={"64": _rate(2000, 20.0)}, concurrent_aio_shared={"64": best})
    figures["floor"]["cores"] = 2
    verdict = _by_aim("WRITE_NO_SYNC", figures)["64 concurrent publishers"]
    assert verdict.verdict == "missed"
    assert "asyncio tasks, one shared" in verdict.measured
    assert "425 µs per event" in verdict.bound
    assert "allows 4,706/s on 2 cores" in verdict.bound
    # A run that measured no CPU (or an older floor without cores) says nothing of it.
    del figures["floor"]["cores"]
    assert "µs" not in _by_aim("WRITE_NO_SYNC", figures)["64 concurrent publishers"].bound


def test_aims_whose_scenarios_did_not_run_or_do_not_apply_are_left_out() -> None:
    assert aims.judge("WRITE_NO_SYNC", _run()) == []
    # No aim is stated for one at a time under NO_SYNC, nor for the proxy under SYNC.
    assert aims.judge("NO_SYNC", _run(one_at_a_time=_rate(900))) == []
    assert aims.judge("SYNC", _run(one_at_a_time_proxy=_rate(900))) == []
    assert aims.table({"NO_SYNC": _run(one_at_a_time=_rate(900))}) == []


def test_the_latency_report_carries_the_verdicts_and_the_concurrent_floor() -> None:
    figures = _run(
        delivery={"latency_ms_p50": 2.5, "latency_ms_p99": 4.0},
        push_delivery={"latency_ms_p50": 1.9, "latency_ms_p99": 3.0},
    )
    figures["floor"].update(
        unary_ms_p50=0.5,
        concurrent={"16": {"calls_per_s": 4000, "latency_ms_p50": 3.9, "latency_ms_p99": 6.4}},
    )
    text = latency.table({"WRITE_NO_SYNC": figures})
    assert "| floor: 16 threads, each ping-ponging on a stream of its own" in text
    assert "| 4,000, 3.9 / 6.4 |" in text
    assert "| WRITE_NO_SYNC | publish -> following subscriber p50 <= 2 ms | 2.00 ms |" in text
    assert text.rstrip().endswith("| met |")


def _chain(
    gateway_rate: float = 700,
    proxy_rate: float = 1000,
    p50_ms: float = 1.2,
    joined_rate: float = 15000,
    joined_p99_ms: float = 7.0,
    callers: int = 64,
) -> dict[str, Any]:
    one = {"events_per_s": gateway_rate, "latency_ms_p50": p50_ms, "latency_ms_p99": 2.0}
    joined = {"events_per_s": joined_rate, "latency_ms_p99": joined_p99_ms, "callers": callers}
    return {
        "gateway": {"one_at_a_time": one, "joined": joined},
        "proxy": {"one_at_a_time": {**one, "events_per_s": proxy_rate}, "joined": joined},
    }


def test_with_the_relay_chain_measured_its_rates_bound_one_publish_at_a_time() -> None:
    # At a 0.5 ms floor the gateway aim scales to 720/s. Three round trips (1.5 ms, 667/s)
    # would call it beyond the floor; the chain measured 800/s, so it is only missed.
    figures = _run(rtt_ms=0.5, one_at_a_time=_rate(300), one_at_a_time_proxy=_rate(400))
    figures["floor"]["chain"] = _chain(gateway_rate=800, proxy_rate=1100)
    verdicts = _by_aim("WRITE_NO_SYNC", figures)
    gateway = verdicts["one at a time through the gateway"]
    assert gateway.verdict == "missed"
    assert gateway.bound == "800/s (the bare relay chain of this path, no work)"
    # Through a proxy the aim scales to 1,200/s, which the chain's 1,100/s does not reach.
    proxy = verdicts["one at a time through a replicated proxy"]
    assert proxy.verdict == "beyond the floor"
    assert proxy.bound.startswith("1,100/s (the bare relay chain")


def test_a_flushing_policy_adds_its_fsync_to_each_publish_of_the_chain() -> None:
    # 1,000/s is 1 ms a publish; a 0.25 ms flush makes it 1.25 ms, 800/s, under the SYNC
    # aim scaled to a 0.3 ms floor (900/s).
    figures = _run(rtt_ms=0.3, fsync_ms=0.25, one_at_a_time=_rate(300))
    figures["floor"]["chain"] = _chain(gateway_rate=1000)
    verdict = _by_aim("SYNC", figures)["one at a time through the gateway"]
    assert verdict.bound.startswith("800/s (the bare relay chain of this path + fsync 0.25 ms")
    assert verdict.verdict == "beyond the floor"


def test_the_64_publisher_aim_is_beyond_the_floor_where_the_joined_chain_misses_it() -> None:
    # A 0.5 ms floor scales the aim to 15,000/s and a p99 of 16.7 ms.
    figures = _run(rtt_ms=0.5, concurrent={"64": _rate(5000, 20.0)})
    figures["floor"]["chain"] = _chain(joined_rate=14000, joined_p99_ms=7.0)
    verdict = _by_aim("WRITE_NO_SYNC", figures)["64 concurrent publishers"]
    assert verdict.verdict == "beyond the floor"
    assert verdict.bound.startswith("the bare relay chain, 64 callers joined: 14,000/s, p99 7.0")
    # The chain passing both halves leaves a slow path merely missed.
    figures["floor"]["chain"] = _chain(joined_rate=16000, joined_p99_ms=7.0)
    assert _by_aim("WRITE_NO_SYNC", figures)["64 concurrent publishers"].verdict == "missed"
    # Its p99 alone over the scaled one puts the aim beyond the floor too.
    figures["floor"]["chain"] = _chain(joined_rate=16000, joined_p99_ms=18.0)
    verdict = _by_aim("WRITE_NO_SYNC", figures)["64 concurrent publishers"]
    assert verdict.verdict == "beyond the floor"
    # A chain run with another number of callers says nothing of 64.
    figures["floor"]["chain"] = _chain(joined_rate=100, callers=16)
    verdict = _by_aim("WRITE_NO_SYNC", figures)["64 concurrent publishers"]
    assert verdict.verdict == "missed"
    assert "relay chain" not in verdict.bound


def test_deliveries_are_bounded_by_the_legs_of_the_chain_they_cross() -> None:
    # The chain's round trip through the gateway, 1.2 ms, is six legs: a following
    # subscriber crosses all six, a push endpoint five (1.0 ms).
    figures = _run(
        rtt_ms=0.3,
        delivery={"latency_ms_p50": 2.5},
        push_delivery={"latency_ms_p50": 2.1},
    )
    figures["floor"]["chain"] = _chain(p50_ms=1.2)
    verdicts = _by_aim("WRITE_NO_SYNC", figures)
    assert verdicts["publish -> following subscriber"].bound.startswith("1.20 ms (6 of the")
    assert verdicts["publish -> push endpoint"].bound.startswith("1.00 ms (5 of the")
    assert verdicts["publish -> push endpoint"].verdict == "missed"
    figures["floor"]["chain"] = _chain(p50_ms=2.7)
    assert _by_aim("WRITE_NO_SYNC", figures)["publish -> following subscriber"].verdict == (
        "beyond the floor"
    )
