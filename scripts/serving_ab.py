#!/usr/bin/env python3
"""Serving A/B of several trees, point by point: one tritonserver start per point, the trees alternated in
the order given, so that every ratio compares runs of one machine start (ikbo_backend.perf.serving_ab).

A point is TREE:INSTANCES:CONCURRENCY: the model copied from that tree with INSTANCES per instance
group, served by the tree's own `scripts/serve`, measured by this tree's `scripts/perf_sweep.py` at
concurrency C.

    mkdir -p out/old && git archive <commit> | tar -x -C out/old   # the other tree
    python scripts/serving_ab.py --tree old=out/old --tree new=. --config large \\
        --points old:1:1 new:1:1 new:3:12 old:3:12 --rounds 2 --out out/ab

Writes into --out: summary.md (a row per point as run; then per instances and concurrency the median
candidates/s of each tree and its ratio to the first tree named), points.csv, and per point
<i>_<tree>_n<instances>_c<c>/ with the server's log and the sweep's files. --rounds N runs the points N
times, every second round in reverse (ABBA: a drift of the machine over the run favours no tree). Points
that would start after --budget-s are skipped and listed. Exit status 1 when a point failed (its row says why).
"""

import sys

from ikbo_backend.perf.serving_ab import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__.split("\n\n")[0]))
