"""Device time of one call, without the host's launch time: what CUPTI (torch.profiler) saw the GPU do.

`triton.testing.do_bench` times a call between two CUDA events recorded around it after an L2 flush. When
the host takes longer to enqueue the call's launches than the GPU takes to flush L2, the GPU sits idle
after the start event and that wait is counted as the call's time. `device_ms` keeps do_bench's
conditions (L2 flushed before each call, calls one at a time) and reads the GPU's own timestamps:

    flush, marker kernel, fn(), flush, marker, fn(), …, flush, marker

A call's device activities (kernels, memsets, copies) are those after its marker, less the flush's at
the end of the segment. Per call: `span` = first start → last end (counts the gaps between the call's
launches), `busy` = the length of the union of its activities (the launches packed back to back, as a
CUDA-graph replay nearly does). Medians over the calls, in ms.

The marker is torch.cuda._sleep's spin kernel, which runs a given count of SM clock cycles, so its duration
just before each call gives the SM clock at that moment (`sm_mhz`; the GPU's power cap sets it, and it moves
between machines and with the recent load). The spin's fixed launch cost is measured once with two spin
lengths and taken off.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: never launched by the code under test
SPIN_CYCLES = 50_000  # the marker's length in SM cycles (≈ 30 µs)
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


@dataclass(frozen=True)
class DeviceTime:
    span_ms: float
    busy_ms: float
    activities: int  # device activities per call (the median call's count)
    sm_mhz: float  # SM clock just before the call (median over the calls)


def marker_durations(activities: list[tuple[str, float, float]]) -> list[float]:
    """Durations (µs) of the marker activities, in time order."""
    return [dur for name, _, dur in sorted(activities, key=lambda a: a[1]) if MARKER in name]


def clock_mhz(spin_us: float, spin_cycles: int, fixed_us: float) -> float:
    """SM clock (MHz = cycles per µs) from a spin of `spin_cycles` that took `spin_us`, less its fixed cost."""
    return spin_cycles / (spin_us - fixed_us)


def call_segments(activities: list[tuple[str, float, float]], flush_count: int) -> list[list[tuple[float, float]]]:
    """Split device activities (name, start µs, duration µs), in any order, at the marker activities.
    Each segment between two markers is one call's activities followed by the next flush's
    `flush_count`, which are dropped. Returns one [(start, end) µs] list per call."""
    ordered = sorted(activities, key=lambda a: a[1])
    markers = [i for i, (name, _, _) in enumerate(ordered) if MARKER in name]
    segments = []
    for first, last in zip(markers, markers[1:]):
        inside = ordered[first + 1:last]
        if len(inside) < flush_count:
            raise ValueError(f"a segment holds {len(inside)} activities, fewer than the flush's {flush_count}")
        segments.append([(start, start + dur) for _, start, dur in inside[:len(inside) - flush_count]])
    return segments


def span_and_busy(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(first start → last end, length of the union) of [(start, end)] intervals; (0, 0) if none."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, cur_start, cur_end = 0.0, *intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return max(e for _, e in intervals) - intervals[0][0], busy


def _trace_activities(prof) -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
            if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]


def device_ms(fn, calls: int = 50, warmup: int = 5) -> DeviceTime:
    """Median device span and busy time (ms) of `fn` over `calls` calls, each after an L2 flush (CUDA only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from triton import runtime

    driver = runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()

    def flush_and_mark(cycles=SPIN_CYCLES):
        driver.clear_cache(cache)
        torch.cuda._sleep(cycles)

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # calibration, no call in these segments: what one flush launches, and the spin's fixed cost
        for cycles in (SPIN_CYCLES, SPIN_CYCLES, 2 * SPIN_CYCLES, SPIN_CYCLES):
            flush_and_mark(cycles)
        for _ in range(calls):
            fn()
            flush_and_mark()
        torch.cuda.synchronize()
    activities = _trace_activities(prof)
    segments = call_segments(activities, flush_count=0)
    flush_count = len(segments[0])  # between the first two markers: one flush and nothing else
    if any(len(s) != flush_count for s in segments[:3]):
        raise RuntimeError(f"a flush launched {[len(s) for s in segments[:3]]} device activities, not a fixed count")
    per_call = [span_and_busy(s[:len(s) - flush_count]) for s in segments[3:]]
    if len(per_call) != calls:
        raise RuntimeError(f"{len(per_call)} call segments in the trace for {calls} calls")
    counts = sorted(len(s) - flush_count for s in segments[3:])
    spins = marker_durations(activities)
    fixed_us = 2 * spins[1] - spins[2]  # spins[1] = fixed + c/f, spins[2] = fixed + 2c/f
    clocks = [clock_mhz(spin, SPIN_CYCLES, fixed_us) for spin in spins[3:3 + calls]]  # the marker before each call
    return DeviceTime(statistics.median(s for s, _ in per_call) / 1e3, statistics.median(b for _, b in per_call) / 1e3,
                      counts[len(counts) // 2], statistics.median(clocks))
