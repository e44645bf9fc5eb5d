"""Soak: load at a fraction of the measured peak, the server's RSS and GPU memory sampled each second."""

from __future__ import annotations

import time

from ..perf.gpu_memory import gpu_memory_used_mib
from ..process_tree import tree_rss_bytes
from ..ranker import RankerConfig
from . import CFG
from .load import Load, measure_peak


def soak(server, seconds: float, fraction: float = 0.7, peak_seconds: float = 10, cfg: RankerConfig = CFG) -> dict:
    """Load at `fraction` of the measured peak for `seconds`; server RSS (tritonserver + stubs) and,
    where there is a GPU, its memory in use sampled each second; growth = max in the second half -
    value at mid-run (RSS: < 100 MB; GPU memory: flat, ≤ 64 MiB)."""
    peak = measure_peak(server.http_url, peak_seconds, cfg=cfg)
    rate = fraction * peak
    samples = []
    with Load(server.http_url, threads=4, rate=rate, max_seconds=seconds + 30, cfg=cfg) as load:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            samples.append((time.monotonic() - start, tree_rss_bytes(server.process.pid), gpu_memory_used_mib()))
            time.sleep(1.0)
    second_half = [s for s in samples if s[0] >= seconds / 2]
    mid = second_half[0][1]
    growth = max(s[1] for s in second_half) - mid
    gpu = {}
    if all(s[2] is not None for s in samples):
        gpu_growth = max(s[2] for s in second_half) - second_half[0][2]
        gpu = {
            "gpu_mib_start": samples[0][2],
            "gpu_mib_mid": second_half[0][2],
            "gpu_mib_end": samples[-1][2],
            "gpu_growth_from_mid_mib": gpu_growth,
        }
    errors = load.errors()
    return {
        "seconds": seconds,
        "peak_rps": round(peak, 1),
        "target_rps": round(rate, 1),
        "achieved_rps": round(len(load.log) / seconds, 1),
        "requests": len(load.log),
        "errors": len(errors),
        "error_examples": sorted({e[2][:200] for e in errors})[:5],
        "rss_start_mb": round(samples[0][1] / 2**20, 1),
        "rss_mid_mb": round(mid / 2**20, 1),
        "rss_end_mb": round(samples[-1][1] / 2**20, 1),
        "rss_growth_from_mid_mb": round(growth / 2**20, 1),
        **gpu,
        "failures": ([f"{len(errors)} unexpected errors"] if errors else [])
        + ([f"RSS grew {growth / 2**20:.0f} MB from mid-run"] if growth >= 100 * 2**20 else [])
        + (
            [f"GPU memory grew {gpu['gpu_growth_from_mid_mib']} MiB from mid-run"]
            if gpu and gpu["gpu_growth_from_mid_mib"] > 64
            else []
        ),
    }
