"""Deferred index-value checks (kernels._common._DeferredChecks): a bad value found after an eager call
returned raises at the next IKBO call that finds its readback arrived, at check_deferred(), or at once in
strict mode. Verdicts here are stand-ins (the real ones are words of pinned host memory that kernels write), but
for the CUDA test of the ring of those words."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreted import run_interpreted

from kernels import _common, check_deferred, strict_checks

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


class StandInReadback:
    def __init__(self, values, arrived=False):
        self._values, self.arrived, self.waited, self.queried = values, arrived, False, 0

    def done(self):
        self.queried += 1
        return self.arrived

    def values(self):
        self.waited = True
        return self._values


def in_range(high):
    def check(values):
        low, top = values
        if low < 0 or top >= high:
            raise ValueError(f"cand_to_user: value {low if low < 0 else top} is outside [0, U={high})")

    return check


@pytest.fixture
def deferred(monkeypatch):
    checks = _common._DeferredChecks()
    checks.strict = False
    monkeypatch.setattr(_common, "DEFERRED", checks)
    return checks


def test_a_bad_value_raises_once_its_values_arrive(deferred):
    late = StandInReadback([0, 7])
    deferred.defer(late, in_range(5))
    _common.poll_deferred()  # not arrived: nothing waits, nothing raises
    assert not late.waited and len(deferred.pending) == 1
    late.arrived = True
    with pytest.raises(ValueError, match="cand_to_user: value 7 is outside"):
        _common.poll_deferred()
    assert deferred.pending == []
    _common.poll_deferred()  # reported once


def test_good_values_pass_and_leave_nothing_pending(deferred):
    for high in (3, 9):
        deferred.defer(StandInReadback([0, high - 1], arrived=True), in_range(high))
    _common.poll_deferred()
    assert deferred.pending == []


def test_check_deferred_waits_for_every_check(deferred):
    good, bad = StandInReadback([0, 1]), StandInReadback([-2, 1])
    deferred.defer(good, in_range(2))
    deferred.defer(bad, in_range(2))
    with pytest.raises(ValueError, match="value -2"):
        check_deferred()
    assert good.waited and bad.waited and deferred.pending == []


def test_strict_mode_raises_at_once(deferred):
    bad = StandInReadback([0, 4])
    with strict_checks(), pytest.raises(ValueError, match="value 4"):
        deferred.defer(bad, in_range(4))
    assert not deferred.strict and deferred.pending == []


def test_a_caller_that_never_synchronizes_waits_for_its_oldest_check(deferred, monkeypatch):
    monkeypatch.setattr(deferred, "MAX_PENDING", 2)
    first = StandInReadback([0, 9])
    deferred.defer(first, in_range(3))
    deferred.defer(StandInReadback([0, 1]), in_range(3))
    with pytest.raises(ValueError, match="value 9"):
        deferred.defer(StandInReadback([0, 1]), in_range(3))
    assert first.waited and len(deferred.pending) == 2


def test_a_poll_stops_at_the_oldest_readback_in_flight(deferred):
    """Readbacks on a stream arrive in order: a host far ahead of the device pays for one query a call, not one per
    pending check; the checks behind the one in flight run once it has arrived, oldest first."""
    arrived = StandInReadback([0, 1], arrived=True)
    in_flight = StandInReadback([0, 1])
    behind = [StandInReadback([0, 8 if i == 3 else 1], arrived=True) for i in range(5)]
    for readback in (arrived, in_flight, *behind):
        deferred.defer(readback, in_range(3))
    _common.poll_deferred()
    assert arrived.waited and not in_flight.waited and in_flight.queried == 1
    assert all(r.queried == 0 and not r.waited for r in behind) and len(deferred.pending) == 6
    in_flight.arrived = True
    with pytest.raises(ValueError, match="value 8"):
        _common.poll_deferred()
    assert behind[3].waited and not behind[4].waited and deferred.pending == [(behind[4], deferred.pending[0][1])]


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_index_check_kernel_interpreted's child process")
@settings(max_examples=12, deadline=None)
@given(
    values=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=700),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    step=st.integers(1, 3),
    high=st.integers(0, 2**40),
)
def test_interpreted_index_check(values, dtype, step, high):
    """The verdict 1 + (a value outside [0, high]) in one launch: any length (several blocks), int32 and int64, a
    strided view."""
    if dtype == torch.int32:
        values = [max(-(2**31), min(2**31 - 1, v)) for v in values]
    spread = torch.tensor([v for v in values for _ in range(step)], dtype=dtype)[::step]
    flag = torch.full((1,), -7, dtype=torch.int32)
    _common.index_check(spread, high, flag)
    assert flag.item() == 1 + any(v < 0 or v > high for v in values)


@pytest.mark.skipif(INTERPRETING, reason="already interpreting")
def test_index_check_kernel_interpreted():
    run_interpreted(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host flags are pinned words that CUDA kernels write")
def test_cuda_host_flags_come_round(monkeypatch, deferred):
    """More eager calls than the ring has words: each word is handed out again only after its check ran, a bad
    value on a word that came round still raises, naming the value, and good calls after it pass."""
    monkeypatch.setattr(_common._HostFlagRing, "SIZE", 8)
    monkeypatch.setattr(_common._HostFlagRing, "_rings", {})
    monkeypatch.setattr(deferred, "MAX_PENDING", 5)
    good = torch.randint(0, 3, (1000,), device="cuda")
    for _ in range(20):
        _common.check_mapping_values(good, 3)
        assert len(deferred.pending) <= 5
    bad = good.clone()
    bad[617] = 3
    _common.check_mapping_values(bad, 3)
    with pytest.raises(ValueError, match=r"cand_to_user: value 3 is outside \[0, U=3\)"):
        check_deferred()
    for _ in range(10):
        _common.check_mapping_values(good, 3)
    check_deferred()
