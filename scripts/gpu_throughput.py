#!/usr/bin/env python3
"""Per-GPU and total candidates/s of a running tritonserver, from its Prometheus metrics.

Reads /metrics before and after a measurement window and reports the increments of the IKBO
counters per model and device, and Triton's counts per model and gpu_uuid
(ikbo_backend.perf.gpu_throughput). The window is a command run after `--` (e.g. a perf_sweep point
against the same server), else --duration seconds of whatever load is running:

    python scripts/gpu_throughput.py --url localhost:8002 -- \\
        python scripts/perf_sweep.py --url localhost:8000 --rankers ikbo_ranker --mixes <mix> --concurrency 8 --protocols grpc
    python scripts/gpu_throughput.py --url localhost:8002 --duration 60 --json out/gpu_throughput.json

Prints markdown tables; exits with the command's status.
"""

import sys

from ikbo_backend.perf.gpu_throughput import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__.split("\n")[0]))
