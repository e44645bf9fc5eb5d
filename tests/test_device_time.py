"""scripts/device_time.py: splitting a profiler trace into calls, and span / busy time per call, against a
brute-force reference on hypothesis-drawn traces (CPU); the profiler itself on the GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from device_time import MARKER, SPIN_CYCLES, call_segments, clock_mhz, device_ms, marker_durations, span_and_busy  # noqa: E402

interval = st.tuples(st.integers(0, 200), st.integers(1, 50)).map(lambda t: (float(t[0]), float(t[0] + t[1])))


@settings(max_examples=200, deadline=None)
@given(st.lists(interval, min_size=1, max_size=8))
def test_span_and_busy_match_a_unit_grid(intervals):
    covered = {t for start, end in intervals for t in range(int(start), int(end))}  # unit cells, integer bounds
    span, busy = span_and_busy(intervals)
    assert busy == len(covered)
    assert span == max(e for _, e in intervals) - min(s for s, _ in intervals)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(1, 30), max_size=4), min_size=1, max_size=6), st.integers(1, 2), st.randoms())
def test_call_segments_recover_each_call(calls, flush_count, rng):
    """Build a trace: marker, then per call its activities, the flush's, a marker; shuffled."""
    trace, expected, t = [(MARKER, 0.0, 1.0)], [], 2.0
    for durations in calls:
        mine = []
        for d in durations:
            trace.append(("ikbo_kernel", t, float(d)))
            mine.append((t, t + d))
            t += d + rng.randint(0, 5)
        for _ in range(flush_count):
            trace.append(("fill", t, 10.0))
            t += 11.0
        trace.append((f"void at::{MARKER}(long)", t, 1.0))
        t += 2.0
        expected.append(mine)
    rng.shuffle(trace)
    assert call_segments(trace, flush_count) == expected


@settings(max_examples=50, deadline=None)
@given(st.floats(500, 2500), st.floats(0, 5), st.randoms())
def test_clock_from_two_spin_lengths(mhz, fixed_us, rng):
    """Spins of c and 2c cycles at `mhz` with a fixed cost: the fixed cost comes out, then the clock."""
    spin = [fixed_us + cycles / mhz for cycles in (SPIN_CYCLES, 2 * SPIN_CYCLES, SPIN_CYCLES)]
    trace = [(MARKER, float(i * 1000), dur) for i, dur in enumerate(spin)] + [("other", 500.0, 3.0)]
    rng.shuffle(trace)
    durations = marker_durations(trace)
    assert durations == spin
    fixed = 2 * durations[0] - durations[1]
    assert abs(clock_mhz(durations[2], SPIN_CYCLES, fixed) - mhz) <= 1e-6 * mhz


def test_call_segments_reject_a_short_segment():
    with pytest.raises(ValueError, match="fewer than the flush"):
        call_segments([(MARKER, 0.0, 1.0), (MARKER, 2.0, 1.0)], flush_count=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_cuda_device_ms_counts_the_call_not_the_host():
    """A matmul after a host wait: the device span is the matmul's, close to its busy time, and the
    activities per call are the one kernel."""
    import time

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def slow_host_call():
        time.sleep(0.002)  # 2 ms on the host before the launch
        return a @ a

    result = device_ms(slow_host_call, calls=10)
    assert result.activities == 1
    assert 0 < result.busy_ms <= result.span_ms < 1.0  # far under the 2 ms host wait
    props = torch.cuda.get_device_properties(0)
    max_mhz = getattr(props, "clock_rate", 0) / 1e3 or 5000.0  # kHz when torch reports it
    assert 100 < result.sm_mhz <= 1.05 * max_mhz
