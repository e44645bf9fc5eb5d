#!/usr/bin/env python3
"""Reliability and security suite against a real tritonserver: malformed-request storms, a test-only
fault inside execute, stub kill -9 under load, graceful shutdown, a broken model, soak, restricted APIs,
the online endpoints' batch isolation and queue full (ikbo_backend.reliability, one module per row).
The short forms run in `make test` (tests/test_reliability*.py); the long forms here, one subcommand a
row, each printing a JSON line of figures:

    .venv/bin/python scripts/reliability.py storm --requests 1000     # per protocol, both rankers
    .venv/bin/python scripts/reliability.py fault
    .venv/bin/python scripts/reliability.py kill --kills 20
    .venv/bin/python scripts/reliability.py kill --kills 20 --replicas 2   # serve --replicas 2
    .venv/bin/python scripts/reliability.py shutdown
    .venv/bin/python scripts/reliability.py broken
    .venv/bin/python scripts/reliability.py soak --seconds 600
    .venv/bin/python scripts/reliability.py soak --attach localhost:8000 --server-pid PID --profile large
    .venv/bin/python scripts/reliability.py all --out out/reliability.json

Exit status 1 when a row failed (its problems on stderr).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ikbo_backend.ranker import PROFILES
from ikbo_backend.reliability.suite import ROWS, attached_soak, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("row", choices=(*ROWS, "all"))
    parser.add_argument("--rounds", type=int, default=20, help="online: interleaved rounds per endpoint")
    parser.add_argument("--bursts", type=int, default=10, help="online: queue-full bursts")
    parser.add_argument("--queue-size", type=int, default=8, help="online: max_queue_size of the copy")
    parser.add_argument("--requests", type=int, default=1000, help="storm: malformed requests per protocol")
    parser.add_argument("--seed", type=int, default=None, help="storm: hypothesis seed (default: random)")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=1, help="harden, kill, shutdown: scripts/serve --replicas N")
    parser.add_argument("--seconds", type=float, default=600, help="soak duration")
    parser.add_argument("--fraction", type=float, default=0.7, help="soak load as a fraction of the measured peak")
    parser.add_argument(
        "--attach", metavar="HTTP_URL", help="soak: a server already running (its rankers), e.g. the GPU run's"
    )
    parser.add_argument("--server-pid", type=int, help="with --attach: tritonserver's pid (RSS of it and its stubs)")
    parser.add_argument(
        "--profile", default="demo", choices=sorted(PROFILES), help="with --attach: the served model's dims"
    )
    parser.add_argument("--exit-timeout", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON results here")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rows = ROWS if args.row == "all" else (args.row,)
    if args.attach:
        if rows != ("soak",) or args.server_pid is None:
            parser.error("--attach runs the soak row only, and needs --server-pid")
        results = attached_soak(args.attach, args.server_pid, args.seconds, args.fraction, args.profile)
    else:
        results = run(
            rows, seed, requests=args.requests, kills=args.kills, replicas=args.replicas, seconds=args.seconds,
            fraction=args.fraction, exit_timeout=args.exit_timeout, rounds=args.rounds, bursts=args.bursts,
            queue_size=args.queue_size,
        )  # fmt: skip
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(results) + "\n")
    failed = {row: r["failures"] for row, r in results.items() if isinstance(r, dict) and r.get("failures")}
    for row, problems in failed.items():
        print(f"FAIL {row}: {len(problems)} problem(s), e.g. {problems[:3]}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
