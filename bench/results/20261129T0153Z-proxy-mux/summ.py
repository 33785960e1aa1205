"""Summarize the alternating before/after runs: medians and after/before ratios."""
import json, statistics, glob, os
rows = {}
def cpu_us(r, who):
    pct = r.get("cpu_pct", {})
    if who == "master":
        val = max(v for k, v in pct.items() if k.startswith("replica"))
    else:
        val = pct.get(who, 0.0)
    return val / 100 * r["seconds"] / r["events"] * 1e6
def figs(d):
    out = {}
    out["proxy 1-at-a-time /s"] = d["one_at_a_time_proxy"]["events_per_s"]
    out["proxy 1-at-a-time p50"] = d["one_at_a_time_proxy"]["latency_ms_p50"]
    for n in ("1", "16", "64"):
        r = d["concurrent_proxy"][n]
        out[f"proxy {n} /s"] = r["events_per_s"]
        out[f"proxy {n} p50"] = r["latency_ms_p50"]
        out[f"proxy {n} p99"] = r["latency_ms_p99"]
        if n != "1":
            out[f"proxy {n} client us/ev"] = cpu_us(r, "client")
            out[f"proxy {n} master us/ev"] = cpu_us(r, "master")
        g = d["concurrent"][n]
        out[f"gateway {n} /s"] = g["events_per_s"]
        out[f"gateway {n} p99"] = g["latency_ms_p99"]
    return out
runs = {"before": [], "after": []}
for side in runs:
    for f in sorted(glob.glob(f"/tmp/pm-bench/{side}-*.json")):
        runs[side].append(figs(json.load(open(f))["WRITE_NO_SYNC"]))
keys = list(runs["before"][0])
print(f"{'figure':28} {'before':>30} {'after':>30} {'ratio med':>9}")
for k in keys:
    b = [r[k] for r in runs["before"]]; a = [r[k] for r in runs["after"]]
    mb, ma = statistics.median(b), statistics.median(a)
    fmt = lambda xs: "/".join(f"{x:.4g}" for x in xs)
    print(f"{k:28} {fmt(b):>30} {fmt(a):>30} {ma/mb:9.2f}")
