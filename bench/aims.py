"""Issue 16's latency aims, judged in each run against the floor that run measured.

The aims are stated for a quiet 2-core machine where one bare Python gRPC round trip takes
about 0.3 ms (`AIM_FLOOR_MS`), to be scaled by the floor measured in the same run
otherwise: a rate aim by 0.3 ms / floor, a latency aim by floor / 0.3 ms (the floor is
`bench.latency.floor`'s stream ping-pong, the path a publisher takes). Each aim gets one
of three verdicts:

* met: the measured figure reaches the scaled aim;
* beyond the floor: the scaled aim asks for less time than the round trips the path
  cannot avoid, with no work done at all (`bound`), so no code on this machine meets it;
* missed: neither.

The bounds, in floors (`rtt`) and flushes (`fsync`: the floor's write and fsync of 4 KiB
where the stores are):

* one publish at a time through the gateway crosses three round trips (app - gateway,
  gateway - master, master - slave), through a replicated proxy two; a policy that
  flushes adds the slave's fsync, which lies between its receipt and its ack;
* publish -> following subscriber through the gateway is six one-way legs (app, gateway,
  master, slave, master, gateway, subscriber), three round trips; publish -> push endpoint
  five legs (the master calls the endpoint itself), two and a half; plus the fsync when
  the policy flushes;
* 64 concurrent publishers: no bound is derived. The floor's concurrent figure (64
  threads, each ping-ponging on a stream of its own with nothing behind the answer) is
  shown beside the aim for scale, not as a limit: the library joins concurrent callers'
  events into shared requests (`squall._publish_mux`) and so can pass it. Beside it, the
  CPU the best path used per event over the client, the gateway and the replicas, and
  the rate the machine's cores would allow at that cost: not a floor (it is Squall's own
  work, which code can cut) but the arithmetic that says how far the work is from the aim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AIM_FLOOR_MS = 0.3
FLUSHING_POLICIES = ("SYNC",)


@dataclass(frozen=True)
class Verdict:
    """One aim against one run's figures."""

    aim: str
    scaled: str
    measured: str
    bound: str
    verdict: str


def _rate_verdict(
    aim: str, target: float, rtt_ms: float, measured: float, bound: float | None, what: str
) -> Verdict:
    scaled = target * AIM_FLOOR_MS / rtt_ms
    if measured >= scaled:
        verdict = "met"
    elif bound is not None and bound < scaled:
        verdict = "beyond the floor"
    else:
        verdict = "missed"
    return Verdict(
        aim=aim,
        scaled=f"{scaled:,.0f}/s",
        measured=f"{measured:,.0f}/s ({measured / scaled:.2f}x)",
        bound=f"{bound:,.0f}/s ({what})" if bound is not None else what,
        verdict=verdict,
    )


def _latency_verdict(
    aim: str, target_ms: float, rtt_ms: float, measured_ms: float, bound_ms: float, what: str
) -> Verdict:
    scaled = target_ms * rtt_ms / AIM_FLOOR_MS
    if measured_ms <= scaled:
        verdict = "met"
    elif bound_ms > scaled:
        verdict = "beyond the floor"
    else:
        verdict = "missed"
    return Verdict(
        aim=aim,
        scaled=f"{scaled:.2f} ms",
        measured=f"{measured_ms:.2f} ms ({measured_ms / scaled:.2f}x)",
        bound=f"{bound_ms:.2f} ms ({what})",
        verdict=verdict,
    )


def _cpu_allows(figures: dict[str, Any], cores: int | None) -> str:
    """The CPU one scenario's run used per event over the client, the gateway and every
    replica (`cpu_pct`, % of one core over the run), and the rate `cores` would allow at
    that cost; "" when either is unknown."""
    cpu = figures.get("cpu_pct", {})
    pct = sum(v for k, v in cpu.items() if k.startswith(("client", "gateway", "replica")))
    rate = figures.get("events_per_s", 0)
    if not (pct > 0 and rate > 0 and cores):
        return ""
    us_per_event = 10_000 * pct / rate
    return (
        f"its CPU, {us_per_event:,.0f} µs per event over client, gateway and replicas, "
        f"allows {cores * 1_000_000 / us_per_event:,.0f}/s on {cores} cores"
    )


def judge(policy: str, figures: dict[str, Any]) -> list[Verdict]:
    """The aims that apply to `policy`, judged on one run's `bench.latency.measure` figures
    (an aim whose scenario did not run is left out)."""
    floor = figures["floor"]
    rtt = float(floor["stream_ms_p50"])
    if rtt <= 0:
        return []
    flushes = policy in FLUSHING_POLICIES
    fsync = float(floor.get("fsync_ms_p50") or 0.0) if flushes else 0.0
    plus = f" + fsync {fsync:.2f} ms" if flushes else ""
    out: list[Verdict] = []
    gateway_aim = {"WRITE_NO_SYNC": 1200, "SYNC": 900}.get(policy)
    if gateway_aim and "one_at_a_time" in figures:
        network_ms = 3 * rtt + fsync
        out.append(
            _rate_verdict(
                f"one at a time through the gateway >= {gateway_aim:,}/s",
                gateway_aim,
                rtt,
                figures["one_at_a_time"]["events_per_s"],
                1000 / network_ms,
                f"3 round trips{plus}, no work",
            )
        )
    if policy == "WRITE_NO_SYNC" and "one_at_a_time_proxy" in figures:
        out.append(
            _rate_verdict(
                "one at a time through a replicated proxy >= 2,000/s",
                2000,
                rtt,
                figures["one_at_a_time_proxy"]["events_per_s"],
                1000 / (2 * rtt),
                "2 round trips, no work",
            )
        )
    concurrent = figures.get("concurrent", {}).get("64")
    if concurrent is not None:
        paths = {
            "own publishers": concurrent,
            "one shared publisher": figures.get("concurrent_shared", {}).get("64"),
            "asyncio tasks, own publishers": figures.get("concurrent_aio", {}).get("64"),
            "asyncio tasks, one shared": figures.get("concurrent_aio_shared", {}).get("64"),
        }
        name, best = max(
            ((k, v) for k, v in paths.items() if v is not None),
            key=lambda kv: kv[1]["events_per_s"],
        )
        scaled_p99 = 10 * rtt / AIM_FLOOR_MS
        rate = _rate_verdict(
            "64 concurrent publishers >= 25,000/s with p99 <= 10 ms",
            25000,
            rtt,
            best["events_per_s"],
            None,
            "",
        )
        bare = floor.get("concurrent", {}).get("64")
        beside = (
            f"for scale, bare gRPC from 64 threads: {bare['calls_per_s']:,}/s, "
            f"p99 {bare['latency_ms_p99']} ms"
            if bare
            else "-"
        )
        work = _cpu_allows(best, floor.get("cores"))
        if work:
            beside = f"{beside}; {work}" if bare else work
        met = rate.verdict == "met" and best["latency_ms_p99"] <= scaled_p99
        out.append(
            Verdict(
                aim=rate.aim,
                scaled=f"{rate.scaled}, p99 {scaled_p99:.1f} ms",
                measured=f"{rate.measured}, p99 {best['latency_ms_p99']} ms ({name})",
                bound=beside,
                verdict="met" if met else "missed",
            )
        )
    legs = (
        ("delivery", "publish -> following subscriber p50 <= 2 ms", 3.0, "3 round trips"),
        ("push_delivery", "publish -> push endpoint p50 <= 2 ms", 2.5, "2.5 round trips"),
    )
    for key, aim, round_trips, what in legs:
        if key in figures:
            out.append(
                _latency_verdict(
                    aim,
                    2.0,
                    rtt,
                    figures[key]["latency_ms_p50"],
                    round_trips * rtt + fsync,
                    f"{what}{plus}, no work",
                )
            )
    return out


def table(policy_figures: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown lines: per policy, each aim against the run's floor."""
    lines = [
        "",
        f"Against issue 16's aims, scaled by this run's floor (stated for a {AIM_FLOOR_MS} ms "
        "round trip; `bench/aims.py`: *beyond the floor* means the round trips the path "
        "cannot avoid, with no work, already take longer than the scaled aim allows):",
        "",
        "| policy | aim | scaled to this floor | measured | the floor alone allows | verdict |",
        "|---|---|---:|---:|---:|---|",
    ]
    rows = 0
    for policy, figures in policy_figures.items():
        for v in judge(policy, figures):
            lines.append(
                f"| {policy} | {v.aim} | {v.scaled} | {v.measured} | {v.bound} | {v.verdict} |"
            )
            rows += 1
    return lines if rows else []
