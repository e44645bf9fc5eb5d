"""Keeping idle CPUs awake for latency (ikbo_backend.idle_cpus: `busy_idle_cpus`,
`cpu_wake_latency`; `scripts/serve --busy-idle / --cpu-wake-latency-us`): the loops run at SCHED_IDLE
on their CPU, end with the context and with a killed parent; the PM QoS request is written and
held while the file is open."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ikbo_backend.idle_cpus import busy_idle_cpus, cpu_wake_latency


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


def wait_gone(pids, seconds=30.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_busy_loops_run_at_sched_idle_on_their_cpu_and_end_with_the_context():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with busy_idle_cpus([cpu]) as loops:
        (loop,) = loops
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(loop.pid) != os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.05)  # the child sets its own policy and affinity first thing
        assert os.sched_getscheduler(loop.pid) == os.SCHED_IDLE
        assert os.sched_getaffinity(loop.pid) == {cpu}
        assert loop.poll() is None
    assert wait_gone([loop.pid]) == []


def test_busy_loops_end_when_their_parent_is_killed():
    code = (
        "import time; from ikbo_backend.idle_cpus import busy_idle_cpus\n"
        "with busy_idle_cpus() as loops:\n    print(' '.join(str(p.pid) for p in loops), flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == len(os.sched_getaffinity(0)) and all(alive(p) for p in pids)
    parent.kill()  # no cleanup runs in the parent
    parent.wait()
    assert wait_gone(pids) == []


def test_cpu_wake_latency_writes_the_request_and_rejects_negatives(tmp_path):
    device = tmp_path / "cpu_dma_latency"  # a file stands in for the character device
    with cpu_wake_latency(25, device=device):
        assert int.from_bytes(device.read_bytes(), sys.byteorder, signed=True) == 25
    with pytest.raises(ValueError, match=">= 0"):
        with cpu_wake_latency(-1, device=device):
            pass
    with pytest.raises(OSError):
        with cpu_wake_latency(0, device=tmp_path / "missing" / "cpu_dma_latency"):
            pass
