#!/usr/bin/env python3
"""Write perf_analyzer `--input-data` files for several U:B mixes (ikbo_backend.perf.inputs).

python scripts/make_perf_configs.py                  # every mix into perf_configs/
python scripts/make_perf_configs.py --mixes u15_b1024 --out /tmp/pc
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ikbo_backend.perf.inputs import DEFAULT_DIR, MIXES, REQUESTS_PER_FILE, write_config
from ikbo_backend.ranker import PROFILES


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--requests", type=int, default=REQUESTS_PER_FILE, help="requests per file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", default="demo", choices=sorted(PROFILES), help="model dims (ikbo_backend.ranker.PROFILES)"
    )
    args = parser.parse_args(argv)
    for name in args.mixes:
        path = write_config(name, args.out, args.requests, args.seed, cfg=PROFILES[args.profile])
        users, candidates = MIXES[name]
        print(f"{path}  U={users} B={candidates} requests={args.requests} {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
