"""SIGTERM to serve under load: in-flight requests finish, serve exits 0, no /dev/shm segment is left."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from ..process_tree import shm_segments
from .load import Load
from .served import Served


def graceful_shutdown(served: Served, exit_timeout: int) -> dict:
    """SIGTERM to serve under load (2 clients, large requests): requests in flight at the signal must
    succeed within the exit timeout, serve must exit 0, and tritonserver's /dev/shm segments be gone."""
    with Load(served.http_url, threads=2, sizes=((64, 2048), (32, 1024))) as load:
        time.sleep(3)
        # closed loop: both clients have a request in flight nearly always
        segments = set().union(*(shm_segments(pid) for pid in served.triton_pids()))  # of every replica
        t_signal = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        load.stop_event.set()  # no new requests; the ones in flight finish
        load.stop()
    try:
        code = served.process.wait(exit_timeout + 30)
    except subprocess.TimeoutExpired:
        code = None
    t_exit = time.monotonic()
    in_flight = [e for e in load.log if e[0] < t_signal < e[1]]
    failed = [e for e in in_flight if e[2]]
    left = sorted(s for s in segments if Path(s).exists())
    failures = []
    if not in_flight:
        failures.append("no request was in flight at SIGTERM")
    if failed:
        failures.append(f"in-flight requests failed: {[e[2][:200] for e in failed]}")
    if any(e[1] - t_signal > exit_timeout for e in in_flight):
        failures.append("an in-flight request finished after the exit timeout")
    if code != 0:
        failures.append(f"serve exit code {code}")
    if left:
        failures.append(f"/dev/shm segments left: {left}")
    return {
        "in_flight_at_sigterm": len(in_flight),
        "in_flight_failed": len(failed),
        "last_in_flight_done_s": round(max((e[1] - t_signal for e in in_flight), default=0), 2),
        "exit_s": round(t_exit - t_signal, 1),
        "exit_code": code,
        "shm_segments_before": len(segments),
        "shm_segments_left": len(left),
        "failures": failures,
    }
