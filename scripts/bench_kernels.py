#!/usr/bin/env python3
"""Kernel benchmarks: `scripts/bench_kernels.py lce|attention|all [options]` runs scripts/bench_lce.py and/or
scripts/bench_attention.py with the options, one process each (GPU; --smoke on the CPU)."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = {"lce": "bench_lce.py", "attention": "bench_attention.py"}


def main(argv):
    if not argv or argv[0] not in (*BENCHMARKS, "all"):
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(BENCHMARKS)}|all}} [options]")
    names = list(BENCHMARKS) if argv[0] == "all" else [argv[0]]
    for name in names:
        script = Path(__file__).resolve().parent / BENCHMARKS[name]
        returncode = subprocess.run([sys.executable, str(script), *argv[1:]]).returncode
        if returncode:
            sys.exit(returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
