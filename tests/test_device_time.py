"""ikbo_backend/perf/device_time.py: finding each call between its markers in a profiler trace, span / busy time, and the
clock from spin lengths, against brute-force references on hypothesis-drawn traces (CPU); the profiler itself on the GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ikbo_backend.perf.device_time import MARKER, SPIN_CYCLES, bracketed_calls, clock_mhz, device_ms, span_and_busy

interval = st.tuples(st.integers(0, 200), st.integers(1, 50)).map(lambda t: (float(t[0]), float(t[0] + t[1])))


@settings(max_examples=200, deadline=None)
@given(st.lists(interval, min_size=1, max_size=8))
def test_span_and_busy_match_a_unit_grid(intervals):
    covered = {t for start, end in intervals for t in range(int(start), int(end))}  # unit cells, integer bounds
    span, busy = span_and_busy(intervals)
    assert busy == len(covered)
    assert span == max(e for _, e in intervals) - min(s for s, _ in intervals)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(1, 30), max_size=4), min_size=1, max_size=6), st.integers(0, 3), st.randoms())
def test_bracketed_calls_recover_each_call(calls, skipped, rng):
    """Build a trace: `skipped` lone markers, then per call a flush, a marker, its activities, a marker; shuffled."""
    trace, expected, t = [], [], 0.0
    for _ in range(skipped):
        trace += [("fill", t, 10.0), (MARKER, t + 11.0, 1.0)]
        t += 13.0
    for i, durations in enumerate(calls):
        trace += [("fill", t, 10.0), (f"void at::{MARKER}(long)", t + 11.0, 1.0)]
        t += 13.0
        mine = []
        for d in durations:
            trace.append(("ikbo_kernel", t, float(d)))
            mine.append((t, t + d))
            t += d + rng.randint(0, 5)
        closing = 2.0 + i
        trace.append((MARKER, t, closing))
        t += closing + 1.0
        expected.append((mine, closing))
    rng.shuffle(trace)
    assert bracketed_calls(trace, skip_markers=skipped) == expected


def test_bracketed_calls_reject_an_odd_marker_count():
    with pytest.raises(ValueError, match="not whole pairs"):
        bracketed_calls([(MARKER, 0.0, 1.0), (MARKER, 2.0, 1.0), (MARKER, 4.0, 1.0)])


@settings(max_examples=50, deadline=None)
@given(st.floats(500, 2500), st.floats(0, 5))
def test_clock_from_two_spin_lengths(mhz, fixed_us):
    """Spins of c and 2c cycles at `mhz` with a fixed cost: the fixed cost comes out, then the clock of a third spin."""
    one, two = (fixed_us + cycles / mhz for cycles in (SPIN_CYCLES, 2 * SPIN_CYCLES))
    fixed = 2 * one - two
    assert abs(clock_mhz(fixed_us + SPIN_CYCLES / mhz, SPIN_CYCLES, fixed) - mhz) <= 1e-6 * mhz


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
