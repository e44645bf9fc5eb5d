"""Deferred index-value checks (kernels._common._DeferredChecks): a bad value found after an eager call
returned raises at the next IKBO call that finds its readback arrived, at check_deferred(), or at once in
strict mode. Readbacks here are stand-ins (the real ones copy CUDA tensors to pinned memory)."""

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


@pytest.mark.skipif(not INTERPRETING, reason="runs in test_index_range_kernel_interpreted's child process")
@settings(max_examples=12, deadline=None)
@given(
    values=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=700),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    step=st.integers(1, 3),
)
def test_interpreted_index_range(values, dtype, step):
    """The readback's [min, max] in one launch: any length (several blocks), int32 and int64, a strided view."""
    if dtype == torch.int32:
        values = [max(-(2**31), min(2**31 - 1, v)) for v in values]
    spread = torch.tensor([v for v in values for _ in range(step)], dtype=dtype)[::step]
    assert _common.index_range(spread).tolist() == [min(values), max(values)]


@pytest.mark.skipif(INTERPRETING, reason="already interpreting")
def test_index_range_kernel_interpreted():
    run_interpreted(__file__)
