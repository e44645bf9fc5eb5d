"""Device time of one call, without the host's launch time: what CUPTI (torch.profiler) saw the GPU do.

`triton.testing.do_bench` times a call between two CUDA events recorded around it after an L2 flush. When
the host takes longer to enqueue the call's launches than the GPU takes to flush L2, the GPU sits idle
after the start event and that wait is counted as the call's time. `device_ms` keeps do_bench's
conditions (L2 flushed before each call, calls one at a time) and reads the GPU's own timestamps:

    flush, marker, fn(), marker, flush, marker, fn(), marker, …

A call's device activities (kernels, memsets, copies) are those between its two markers. Per call: `span` =
first start → last end (counts the gaps between the call's launches), `busy` = the length of the union of
its activities (the launches packed back to back, as a CUDA-graph replay nearly does). Medians over the
calls, in ms.

The marker is torch.cuda._sleep's spin kernel, which runs a given count of SM clock cycles, so the duration of
the marker right after a call gives the SM clock the call left the GPU at (`sm_mhz`; the GPU's power cap sets
it, and it moves between machines and with the load). The spin's fixed cost is measured first, from two spin
lengths, and taken off.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: never launched by the code under test
SPIN_CYCLES = 50_000  # the marker's length in SM cycles (≈ 30 µs)
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


@dataclass(frozen=True)
class DeviceTime:
    span_ms: float
    busy_ms: float
    activities: int  # device activities per call (the median call's count)
    sm_mhz: float  # SM clock right after the call (median over the calls)


def bracketed_calls(activities: list[tuple[str, float, float]], skip_markers: int = 0):
    """Activities (name, start µs, duration µs), in any order → one ([(start, end) µs of the call's
    activities], duration µs of its closing marker) per pair of markers, after the first `skip_markers`
    markers. Activities outside a pair (the flushes) are left out."""
    ordered = sorted(activities, key=lambda a: a[1])
    markers = [i for i, (name, _, _) in enumerate(ordered) if MARKER in name][skip_markers:]
    if len(markers) % 2:
        raise ValueError(f"{len(markers)} markers after the first {skip_markers}: not whole pairs")
    return [
        ([(start, start + dur) for _, start, dur in ordered[opening + 1 : closing]], ordered[closing][2])
        for opening, closing in zip(markers[::2], markers[1::2])
    ]


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


def clock_mhz(spin_us: float, spin_cycles: int, fixed_us: float) -> float:
    """SM clock (MHz = cycles per µs) from a spin of `spin_cycles` that took `spin_us`, less its fixed cost."""
    return spin_cycles / (spin_us - fixed_us)


def _trace_activities(prof) -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [
        (e["name"], float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]


def device_ms(fn, calls: int = 50, warmup: int = 5) -> DeviceTime:
    """Median device span and busy time (ms) of `fn` over `calls` calls, each after an L2 flush (CUDA only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from triton import runtime

    driver = runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for cycles in (SPIN_CYCLES, 2 * SPIN_CYCLES):  # the spin's fixed cost: fixed + c/f and fixed + 2c/f
            driver.clear_cache(cache)
            torch.cuda._sleep(cycles)
        for _ in range(calls):
            driver.clear_cache(cache)
            torch.cuda._sleep(SPIN_CYCLES)
            fn()
            torch.cuda._sleep(SPIN_CYCLES)
        torch.cuda.synchronize()
    activities = _trace_activities(prof)
    spins = [dur for name, _, dur in sorted(activities, key=lambda a: a[1]) if MARKER in name][:2]
    fixed_us = 2 * spins[0] - spins[1]
    per_call = bracketed_calls(activities, skip_markers=2)
    if len(per_call) != calls:
        raise RuntimeError(f"{len(per_call)} bracketed calls in the trace for {calls} calls")
    times = [span_and_busy(intervals) for intervals, _ in per_call]
    counts = sorted(len(intervals) for intervals, _ in per_call)
    return DeviceTime(
        statistics.median(s for s, _ in times) / 1e3,
        statistics.median(b for _, b in times) / 1e3,
        counts[len(counts) // 2],
        statistics.median(clock_mhz(spin, SPIN_CYCLES, fixed_us) for _, spin in per_call),
    )


def wall_ms(fn, runs: int = 3) -> float:
    """Median wall-clock ms of `runs` calls: the stand-in of the timings below on a machine without a GPU (benchmarks'
    --smoke runs), not a measurement."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def device_times(fn, on_gpu: bool = True, calls: int = 50) -> tuple[float, float, float]:
    """(busy ms, span ms, SM MHz) of `device_ms`; wall_ms twice and nan without a GPU."""
    if not on_gpu:
        ms = wall_ms(fn)
        return ms, ms, float("nan")
    measured = device_ms(fn, calls=calls)
    return measured.busy_ms, measured.span_ms, measured.sm_mhz


def event_ms(fn, on_gpu: bool = True) -> float:
    """`triton.testing.do_bench`'s median ms between CUDA events (with the host's launch time wherever it outlasts
    the L2 flush); wall_ms without a GPU."""
    if not on_gpu:
        return wall_ms(fn)
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def host_us(fn, on_gpu: bool = True, calls: int = 50) -> float:
    """Host (CPU) µs per call: `calls` calls enqueued back to back without a sync (the GPU queue does not fill
    at these sizes), so the wall time over them is the host's launch path; nan without a GPU."""
    if not on_gpu:
        return float("nan")
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_ms(fn, on_gpu: bool = True, rep: int = 30) -> float:
    """Median ms of CUDA-graph replays of `fn` (`triton.testing.do_bench_cudagraph`: device time without the host's
    launches); nan without a GPU."""
    if not on_gpu:
        return float("nan")
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
