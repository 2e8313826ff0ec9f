"""The least time a decided sweep must add to a point-verdict sweep.

A point verdict ends a level after its screen (`load.rounds` x the level,
at least `load.min_requests`). A decided verdict must show that the
highest feasible level holds: every latency percentile at the confidence
asked. With no request over a limit, that takes

- `--rule` requests (41 for a p95 at 90% with the default zone: the
  sequential test's floor, `SequentialTest::min_requests`), and
- at the very least `ceil(ln(1 - confidence) / ln(1 - p1))` for any test
  that calls a p95 holding against a breach share p1 (22 at 90% and 10%).

This reads a profile's `probes.csv`, takes each bucket's highest level
decided to hold, its request rate there (all its probes' requests over
their seconds), and prints the seconds that level needs beyond its screen
to reach either count: what deciding costs even when the search wastes
nothing, no screen is noisy and the level above is refused for free.

    python3 scripts/decided-sweep-floor.py PROFILE_DIR --point-sweep-s 294
"""

import argparse
import csv
import math
import os
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="a profile folder with probes.csv")
    ap.add_argument("--rule", type=int, default=41, help="requests the rule needs (41)")
    ap.add_argument("--confidence", type=float, default=0.9)
    ap.add_argument("--p1", type=float, default=0.10, help="the breach share (0.10)")
    ap.add_argument("--screen", type=int, default=4, help="load.min_requests (4)")
    ap.add_argument("--rounds", type=int, default=1, help="load.rounds (1)")
    ap.add_argument(
        "--point-sweep-s",
        type=float,
        help="the point-verdict sweep's wall time on the same machine",
    )
    a = ap.parse_args()
    any_test = math.ceil(math.log(1 - a.confidence) / math.log(1 - a.p1))

    probes = defaultdict(list)
    with open(os.path.join(a.profile, "probes.csv")) as f:
        for r in csv.DictReader(f):
            probes[(r["config"], r["bucket"])].append(r)

    print(f"| config | bucket | held at | req/s there | screen | s to {a.rule} | s to {any_test} |")
    print("|---|---|---|---|---|---|---|")
    totals = [0.0, 0.0]
    for (config, bucket), rows in probes.items():
        held = [int(r["concurrency"]) for r in rows if r["decision"] == "holds"]
        if not held:
            print(f"| {config} | {bucket} | none | | | | |")
            continue
        level = max(held)
        at = [r for r in rows if int(r["concurrency"]) == level]
        rate = sum(int(r["requests"]) for r in at) / sum(float(r["duration_s"]) for r in at)
        screen = max(level * a.rounds, a.screen)
        extra = [max(0, n - screen) / rate for n in (a.rule, any_test)]
        totals = [t + e for t, e in zip(totals, extra)]
        print(
            f"| {config} | {bucket} | {level} | {rate:.2f} | {screen} "
            f"| {extra[0]:.1f} | {extra[1]:.1f} |"
        )
    print(f"| all | | | | | {totals[0]:.0f} | {totals[1]:.0f} |")
    if a.point_sweep_s:
        t = a.point_sweep_s
        print()
        print(f"point-verdict sweep: {t:.0f} s")
        for n, extra in zip((a.rule, any_test), totals):
            print(f"  deciding with {n} requests a held level: at least {(t + extra) / t:.2f}x")


if __name__ == "__main__":
    main()
