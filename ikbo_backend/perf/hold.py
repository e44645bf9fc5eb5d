"""Hold something for as long as this process runs, for a shell script that measures around it; the
thing ends with the process (SIGTERM, as `kill` sends, or the script's `timeout`).

    python -m ikbo_backend.perf.hold server WORK [--config large]   # a tritonserver; WORK/server.env when ready
    python -m ikbo_backend.perf.hold wake-latency 0                  # a PM QoS request on CPU wake latency, µs
    python -m ikbo_backend.perf.hold busy-idle                       # a SCHED_IDLE busy loop on every CPU

WORK/server.env is shell assignments (HTTP, GRPC, METRICS: HOST:PORT; SERVER_PID; READY_S) to source.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from pathlib import Path

from ..idle_cpus import busy_idle_cpus, cpu_wake_latency
from ..tritonserver import running_tritonserver


@contextlib.contextmanager
def _server(work: Path, config: str | None, timeout: float):
    start = time.perf_counter()
    with running_tritonserver(config_name=config, log_path=work / "tritonserver.log", timeout=timeout) as server:
        values = {
            "HTTP": server.http_url, "GRPC": server.grpc_url, "METRICS": server.metrics_url,
            "SERVER_PID": server.process.pid, "READY_S": f"{time.perf_counter() - start:.1f}",
        }  # fmt: skip
        partial = work / ".server.env"
        partial.write_text("".join(f"{key}={value}\n" for key, value in values.items()))
        partial.replace(work / "server.env")  # whole or absent for a reader polling for it
        yield


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    server = sub.add_parser("server", help="a tritonserver over the project's model repository")
    server.add_argument("work", type=Path, help="directory for server.env and tritonserver.log")
    server.add_argument("--config", help="--model-config-name (default: config.pbtxt)")
    server.add_argument("--timeout", type=float, default=500, help="seconds the server gets to be ready")
    wake = sub.add_parser("wake-latency", help="CPUs kept out of idle states slower to leave than this (µs)")
    wake.add_argument("microseconds", type=int)
    sub.add_parser("busy-idle", help="a busy loop per CPU at SCHED_IDLE")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the held thing ends with this process
    if args.what == "server":
        held, message = _server(args.work, args.config or None, args.timeout), "server ready"
    elif args.what == "wake-latency":
        held, message = cpu_wake_latency(args.microseconds), "wake latency held"
    else:
        held, message = busy_idle_cpus(), "busy idle loops"
    with held:
        print(message, flush=True)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
