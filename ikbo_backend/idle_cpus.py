"""Keeping idle CPUs awake while serving, for latency: a request that arrives after an idle gap finds
CPUs that did not halt (`scripts/serve --cpu-wake-latency-us`, `--busy-idle`). Two ways: a Linux PM QoS
request (`cpu_wake_latency`), or a SCHED_IDLE busy loop per CPU (`busy_idle_cpus`) where the host
has no cpuidle driver for PM QoS to act on."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

CPU_DMA_LATENCY = Path("/dev/cpu_dma_latency")


@contextlib.contextmanager
def cpu_wake_latency(microseconds: int, device: Path = CPU_DMA_LATENCY):
    """Linux PM QoS, for as long as the context is held (system-wide, every process): CPUs avoid idle
    states that take longer than `microseconds` to leave (0: no halt; a VM guest with the haltpoll
    idle driver keeps polling). Costs idle power; for latency-bound serving (docs/design/serving.md). Needs
    write access to `device` (root); OSError naming it otherwise."""
    if microseconds < 0:
        raise ValueError(f"microseconds: expected >= 0, got {microseconds}")
    with open(device, "wb", buffering=0) as f:  # the request lasts while the file is open
        f.write(microseconds.to_bytes(4, sys.byteorder, signed=True))
        yield


_BUSY_LOOP = """import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel ends us with our parent
if os.getppid() != int(sys.argv[2]):  # the parent died before that
    sys.exit()
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent ends us
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


@contextlib.contextmanager
def busy_idle_cpus(cpus=None):
    """A busy loop per CPU (default: every CPU this process may use) at SCHED_IDLE, which runs only
    when nothing else wants that CPU: idle CPUs never halt, so a request arriving after an idle gap
    finds them awake. For VM hosts without a cpuidle driver, where a PM QoS request
    (`cpu_wake_latency`) changes nothing. Costs every idle CPU cycle. Yields the loops' processes;
    they end with the context, and (Linux parent-death signal) when the thread that started them ends."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    parent = str(os.getpid())
    loops = [
        subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(cpu), parent], stdin=subprocess.DEVNULL) for cpu in cpus
    ]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
