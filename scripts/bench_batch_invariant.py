#!/usr/bin/env python3
"""In-process CPU cost of the online endpoints' batch-invariant mode, side by side in one run.

Per variant (ikbo, baseline): `default` (torch's kernels as they come) and `invariant`
(`batch_invariant`), timed on the batch the online backend runs for U coalesced one-user requests
(ikbo_backend.perf.batch_invariant_bench): median ms per batch and the ratio invariant/default.

    python scripts/bench_batch_invariant.py                     # 15×1020 (68 candidates a user), 64×4096
    python scripts/bench_batch_invariant.py --shapes 1x68 --runs 200
"""

import argparse
import sys

from ikbo_backend.perf.batch_invariant_bench import rows
from ikbo_backend.perf.machine import environment


def shape(text: str) -> tuple[int, int]:
    users, candidates = (int(x) for x in text.lower().split("x"))
    return users, candidates


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", type=shape, default=[(15, 1020), (64, 4096)], help="UxB: users (= requests) x candidates"
    )
    parser.add_argument("--runs", type=int, default=50, help="timed calls per provider and shape")
    parser.add_argument("--pool", type=int, default=4, help="distinct fixed batches per shape")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    lines = ["| variant | U:B | default ms | invariant ms | invariant / default |", "|---|---|---:|---:|---:|"]
    for row in rows(args.shapes, args.runs, args.pool, args.warmup, args.seed):
        lines.append(row)
        print(row, file=sys.stderr, flush=True)
    print(f"{environment()}; median of {args.runs} calls per cell, providers alternating.\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
