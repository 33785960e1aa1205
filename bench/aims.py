"""Issue 16's latency aims, judged in each run against the floor that run measured.

The aims are stated for a quiet 2-core machine where one bare Python gRPC round trip takes
about 0.3 ms (`AIM_FLOOR_MS`), to be scaled by the floor measured in the same run
otherwise: a rate aim by 0.3 ms / floor, a latency aim by floor / 0.3 ms (the floor is
`bench.latency.floor`'s stream ping-pong, the path a publisher takes). Each aim gets one
of three verdicts:

* met: the measured figure reaches the scaled aim;
* beyond the floor: the path with no work done at all (`bound`: its bare relay chain,
  or in an older report its round trips) does not reach the scaled aim itself, so no
  code on this stack and machine meets it;
* missed: neither.

The bounds come from the bare relay chain of each path when the run measured it
(`bench.chain_floor`, `floor["chain"]`): the cluster's processes in the publish's shape
(app -> gateway -> master -> both slaves, the first slave's ack a majority) as bare gRPC
relays, no work at any hop. Plus `fsync`, the floor's write and fsync of 4 KiB where the
stores are, when the policy flushes:

* one publish at a time, through the gateway or a replicated proxy: the chain's rate one
  message at a time on that path;
* publish -> following subscriber crosses the six legs of the gateway chain's round trip
  (app, gateway, master, slave, master, gateway, subscriber): its p50; publish -> push
  endpoint five of them (the master calls the endpoint itself);
* 64 concurrent publishers: the gateway chain with 64 callers, each one event at a time,
  joined into shared requests as the library joins them (`squall._publish_mux`, the
  same window): its rate and p99. Beside it, for scale, the floor's 64 threads each
  ping-ponging on a stream of its own, and the CPU the best path used per event over the
  client, the gateway and the replicas with the rate the machine's cores would allow at
  that cost.

A run without the chain (older reports) is judged by round trips at the two-process
floor (`rtt`): three through the gateway, two through a proxy, three for a following
subscriber's delivery and two and a half for a push endpoint's; no bound for 64
publishers.
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
    chain = floor.get("chain")
    gateway_aim = {"WRITE_NO_SYNC": 1200, "SYNC": 900}.get(policy)
    if gateway_aim and "one_at_a_time" in figures:
        bound, what = _one_at_a_time_bound(chain, "gateway", 3 * rtt, fsync)
        out.append(
            _rate_verdict(
                f"one at a time through the gateway >= {gateway_aim:,}/s",
                gateway_aim,
                rtt,
                figures["one_at_a_time"]["events_per_s"],
                bound,
                f"{what}{plus}, no work",
            )
        )
    if policy == "WRITE_NO_SYNC" and "one_at_a_time_proxy" in figures:
        bound, what = _one_at_a_time_bound(chain, "proxy", 2 * rtt, fsync)
        out.append(
            _rate_verdict(
                "one at a time through a replicated proxy >= 2,000/s",
                2000,
                rtt,
                figures["one_at_a_time_proxy"]["events_per_s"],
                bound,
                f"{what}, no work",
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
        joined = (chain or {}).get("gateway", {}).get("joined")
        if joined is not None and joined.get("callers") != 64:
            joined = None
        parts = []
        if joined is not None:
            parts.append(
                f"the bare relay chain, 64 callers joined: {joined['events_per_s']:,}/s, "
                f"p99 {joined['latency_ms_p99']} ms"
            )
        if bare:
            parts.append(
                f"for scale, bare gRPC from 64 threads: {bare['calls_per_s']:,}/s, "
                f"p99 {bare['latency_ms_p99']} ms"
            )
        work = _cpu_allows(best, floor.get("cores"))
        if work:
            parts.append(work)
        met = rate.verdict == "met" and best["latency_ms_p99"] <= scaled_p99
        if met:
            verdict = "met"
        elif joined is not None and (
            joined["events_per_s"] < 25000 * AIM_FLOOR_MS / rtt
            or joined["latency_ms_p99"] > scaled_p99
        ):
            verdict = "beyond the floor"
        else:
            verdict = "missed"
        out.append(
            Verdict(
                aim=rate.aim,
                scaled=f"{rate.scaled}, p99 {scaled_p99:.1f} ms",
                measured=f"{rate.measured}, p99 {best['latency_ms_p99']} ms ({name})",
                bound="; ".join(parts) or "-",
                verdict=verdict,
            )
        )
    # A following subscriber's delivery crosses the six legs a publish through the gateway
    # does (app, gateway, master, slave, master, gateway, subscriber); a push endpoint's
    # five of them, the master calling the endpoint itself.
    chain_p50 = (chain or {}).get("gateway", {}).get("one_at_a_time", {}).get("latency_ms_p50")
    legs = (
        ("delivery", "publish -> following subscriber p50 <= 2 ms", 3.0, 6),
        ("push_delivery", "publish -> push endpoint p50 <= 2 ms", 2.5, 5),
    )
    for key, aim, round_trips, of_six in legs:
        if key in figures:
            if chain_p50:
                path_ms = chain_p50 * of_six / 6
                what = f"{of_six} of the bare relay chain's 6 legs"
            else:
                path_ms, what = round_trips * rtt, f"{round_trips:g} round trips"
            out.append(
                _latency_verdict(
                    aim,
                    2.0,
                    rtt,
                    figures[key]["latency_ms_p50"],
                    path_ms + fsync,
                    f"{what}{plus}, no work",
                )
            )
    return out


def _one_at_a_time_bound(
    chain: dict[str, Any] | None, shape: str, round_trips_ms: float, fsync_ms: float
) -> tuple[float, str]:
    """The rate one publish at a time cannot pass on `shape`'s path: the bare relay chain
    of that path measured in the run (`bench.chain_floor`), else its round trips at the
    two-process floor; a flushing policy adds its fsync to each publish."""
    one = (chain or {}).get(shape, {}).get("one_at_a_time")
    if one and one.get("events_per_s"):
        return 1000 / (1000 / one["events_per_s"] + fsync_ms), "the bare relay chain of this path"
    trips = 3 if shape == "gateway" else 2
    return 1000 / (round_trips_ms + fsync_ms), f"{trips} round trips"


def table(policy_figures: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown lines: per policy, each aim against the run's floor."""
    lines = [
        "",
        f"Against issue 16's aims, scaled by this run's floor (stated for a {AIM_FLOOR_MS} ms "
        "round trip; `bench/aims.py`: *beyond the floor* means the path's bare relay chain "
        "(`bench/chain_floor.py`; without it, the round trips the path cannot avoid), with "
        "no work, does not reach the scaled aim itself):",
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
