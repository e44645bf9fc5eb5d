#!/usr/bin/env python3
"""Kernel benchmarks: `scripts/bench_kernels.py lce|attention|all [options]` (GPU; see docs/perf.md)."""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCHMARKS = {"lce": "bench_lce", "attention": "bench_attention"}


def main(argv):
    if not argv or argv[0] not in (*BENCHMARKS, "all"):
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(BENCHMARKS)}|all}} [options]")
    names = list(BENCHMARKS) if argv[0] == "all" else [argv[0]]
    for name in names:
        importlib.import_module(BENCHMARKS[name]).main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
