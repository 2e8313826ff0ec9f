#!/usr/bin/env python3
"""Summarises scripts/vs-peer-harness.sh's OUT as Markdown: per tool, the
highest concurrency it calls acceptable, the TTFT p95 and e2e p50 it reports
there, the requests it sent in all and its wall time; then every level each
tool probed. Standard library only.

    scripts/vs-peer-harness.py OUT [--versions envelope=0.1.0,aiperf=...,guidellm=...]
"""
import argparse
import csv
import json
from pathlib import Path

UNIT_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}


def status(out, tool):
    """(exit status, wall seconds) from OUT/TOOL.status, or (None, None)."""
    try:
        rc, secs = (out / f"{tool}.status").read_text().split()
        return int(rc), float(secs)
    except (OSError, ValueError):
        return None, None


def envelope(out):
    """(answer, levels): answer has level/ttft_p95/e2e_p50/requests/note."""
    profile = json.loads((out / "envelope" / "profile.json").read_text())
    configs = profile["configs"]
    bucket = next((c for c in configs if c["name"] == profile.get("selected")), configs[0])["buckets"][0]
    feasible = bucket["feasible_concurrency"]
    limits = (profile.get("limits") or {}).get("buckets") or []
    safe = limits[0]["safe_concurrency"] if limits else 0
    probe = bucket.get("at_feasible")
    if probe is None:  # the last probe at that level covers its extensions
        probe = next((p for p in reversed(bucket["probes"]) if p["concurrency"] == feasible), None)
    with open(out / "envelope" / "requests.csv", newline="") as f:
        requests = sum(1 for _ in csv.DictReader(f))
    levels = [(p["concurrency"], p["requests"], p["ttft_ms"]["p95"], verdict(p))
              for p in bucket["probes"]]
    note = f"bound: {bucket['binding_constraint']}"
    if bucket.get("feasible_upper") is not None:
        note += f"; known within [{feasible}, {bucket['feasible_upper']:g}]"
    return dict(level=feasible, shown=f"{feasible} (safe {safe})" if feasible else None,
                ttft=probe and probe["ttft_ms"]["p95"],
                e2e=probe and probe["e2e_ms"]["p50"], requests=requests, note=note), levels


def verdict(probe):
    """An envelope probe's TTFT decision, breaches and validity."""
    ttft = [c["decision"] for c in probe.get("slo_checks", []) if c["slo"] == "ttft_p95"]
    v = f"ttft_p95 {ttft[0]}" if ttft else "no ttft check"
    if probe["breaches"]:
        v += "; breached " + ",".join(probe["breaches"])
    return v if probe["valid"] else v + "; invalid"


def aiperf_metric(export, tag, stat):
    m = export.get(tag) or {}
    v = m.get(stat)
    return None if v is None else v * UNIT_MS.get(m.get("unit", "ms"), 1.0)


def aiperf_count(export, tag):
    m = export.get(tag) or {}
    return int(m.get("avg") or m.get("max") or 0)


def aiperf(out):
    history_file = next((out / "aiperf").rglob("search_history.json"), None)
    if history_file is None:
        raise FileNotFoundError(f"no search_history.json under {out / 'aiperf'}")
    history = json.loads(history_file.read_text())
    root = history_file.parent

    def export_of(idx):
        f = next((root / f"search_iter_{idx:04d}").rglob("profile_export_aiperf.json"), None)
        return json.loads(f.read_text()) if f else {}

    levels, requests = [], 0
    for it in history["iterations"]:
        e = export_of(it["iteration_idx"])
        n = aiperf_count(e, "request_count") + aiperf_count(e, "error_request_count")
        requests += n
        conc = next(iter(it["variation_values"].values()))
        levels.append((conc, n, aiperf_metric(e, "time_to_first_token", "p95"),
                       "pass" if it["feasible"] else "fail"))
    best = (history.get("boundary_summary") or {}).get("feasible_max")
    e = export_of(best["iteration_idx"]) if best else {}
    return dict(level=best["value"] if best else 0,
                ttft=aiperf_metric(e, "time_to_first_token", "p95"),
                e2e=aiperf_metric(e, "request_latency", "p50"), requests=requests,
                note=f"stop: {history.get('convergence_reason')}"), levels


def guidellm(out):
    report = json.loads((out / "guidellm" / "benchmarks.json").read_text())
    search = (report.get("conclusions") or [{}])[0]
    levels, at, passing, requests = [], {}, [], 0
    for b in report["benchmarks"]:
        m = b["metrics"]
        streams = b["config"]["strategy"].get("streams")
        n = m["request_totals"]["total"]
        requests += n
        ttft = m["time_to_first_token_ms"]["successful"]
        e2e = m["request_latency"]["successful"]
        att = m.get("slo_attainment")
        at[streams] = (ttft["percentiles"]["p95"], e2e["percentiles"]["p50"] * 1e3)
        if att is not None and att >= 0.95:
            passing.append(streams)
        levels.append((streams, n, ttft["percentiles"]["p95"],
                       "attainment " + ("n/a" if att is None else f"{att:.3f}")))
    best = search.get("best_passing_streams")
    if not search:  # no conclusion written: its rule (attainment >= 0.95), from the runs
        best = max(passing, default=None)
    ttft, e2e = at.get(best, (None, None))
    return dict(level=best or 0, ttft=ttft, e2e=e2e, requests=requests,
                note=f"stop: {search.get('stop_reason')}"), levels


def fmt(v, digits=0):
    return "-" if v is None else f"{v:.{digits}f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--versions", default="")
    a = ap.parse_args()
    versions = dict(kv.split("=", 1) for kv in a.versions.split(",") if "=" in kv)
    rows, probes, notes = [], [], []
    for tool, read in (("envelope", envelope), ("aiperf", aiperf), ("guidellm", guidellm)):
        rc, secs = status(a.out, tool)
        if rc is None:
            continue  # not run
        name = f"{tool} {versions.get(tool, '')}".strip()
        try:
            r, levels = read(a.out)
        except Exception as e:  # noqa: BLE001 - any missing or malformed output
            rows.append(f"| {name} | failed (see {tool}.log) | - | - | - | {fmt(secs, 1)} |")
            notes.append(f"- {tool}: exit {rc}; no result ({type(e).__name__}: {e})")
            continue
        level = r.get("shown") or (str(r["level"]) if r["level"] else "none")
        rows.append(f"| {name} | {level} | {fmt(r['ttft'])} | {fmt(r['e2e'])} "
                    f"| {r['requests']} | {fmt(secs, 1)} |")
        notes.append(f"- {tool}: {r['note']}" + (f"; exit {rc}" if rc else ""))
        probes += [f"| {tool} | {c} | {n} | {fmt(t)} | {v} |" for c, n, t, v in levels]
    print("| tool | acceptable concurrency | TTFT p95 (ms) there | e2e p50 (ms) there "
          "| requests sent | wall (s) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n" + "\n".join(notes))
    print("\nLevels probed, in order:\n")
    print("| tool | concurrency | requests | TTFT p95 (ms) | verdict |")
    print("|---|---|---|---|---|")
    print("\n".join(probes))
    print(f"\nRaw output: {a.out}")


if __name__ == "__main__":
    main()
