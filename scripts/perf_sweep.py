#!/usr/bin/env python3
"""perf_analyzer sweep of both rankers through a real tritonserver: rankers × mixes × concurrency × protocol.

Starts a tritonserver on free ports unless `--url` points at one already running; perf_analyzer once
per (mix, protocol, concurrency, ranker), the rankers back to back (ikbo_backend.perf.sweep). Writes
into --out (default out/perf/): sweep.csv, throughput.png, latency.png, runs/<run>.csv|.log; prints
a markdown table.

    python scripts/perf_sweep.py                        # short CPU sweep (a few minutes)
    python scripts/perf_sweep.py --full                 # every mix, concurrency 1..16, longer windows
    python scripts/perf_sweep.py --url localhost:8000 --grpc-url localhost:8001
    PERF_ANALYZER=/tmp/tb/bin/perf_analyzer python scripts/perf_sweep.py --config-name gpu --full

perf_analyzer: $PERF_ANALYZER, else the one next to this Python (tritonclient[all]), else PATH.
"""

from ikbo_backend.perf.sweep import main

if __name__ == "__main__":
    main(description=__doc__.split("\n\n")[0])
