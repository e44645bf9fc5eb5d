"""Reliability rows on the online (dynamically batched) endpoints, short forms: batch
isolation (bad and good one-user requests interleaved; good answers bit-identical to the same
requests sent alone, in the configs' batch-invariant mode; bad ones 400 naming the input) on the
shipped configs, and queue full on a copy whose max_queue_size is 8
(REJECT: overflow answered 503 "Exceeds maximum queue size", accepted p99 bounded). Long forms:
scripts/reliability.py online.
"""

import secrets

import pytest

from ikbo_backend.reliability.online import batch_isolation, queue_full
from ikbo_backend.reliability.repositories import online_repository
from ikbo_backend.tritonserver import running_tritonserver

SEED = secrets.randbits(31)
pytestmark = pytest.mark.timeout(600)


def test_bad_requests_in_a_batch_do_not_change_the_good_answers():
    """The shipped CPU configs set batch_invariant: every good answer bit-identical to its solo answer."""
    with online_repository() as repo, running_tritonserver(repo) as server:
        result = batch_isolation(server, rounds=2, seed=SEED)
    assert not result["failures"], f"seed {SEED}: {result['failures'][:5]}"
    assert all(m["batch_invariant"] for m in result["per_model"].values()), result
    assert result["bit_identical_to_solo"] == result["good"] > 0 and result["max_rel_err_to_solo"] == 0, result


def test_queue_overflow_is_rejected_with_503_and_accepted_latency_stays_bounded():
    with online_repository(max_queue_size=8) as repo, running_tritonserver(repo) as server:
        result = queue_full(server, bursts=2, p99_bound_s=30)
    assert result["rejected_503"] > 0 and result["accepted"] > 0 and not result["failures"], result
