"""Reliability rows of issue 6, short forms, against one real tritonserver (test-only faults on) over
a copy of the rankers' models: hypothesis-drawn malformed requests of every kind over HTTP and gRPC,
a fault inside execute, a 60 s soak; and a repository with a broken model. The long forms and their
figures: scripts/reliability.py, docs/reliability.md.
"""

import secrets
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import reliability  # noqa: E402

SEED = secrets.randbits(31)
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server():
    with reliability.rankers_repository() as repo, reliability.fault_server(repo) as running:
        yield running


def test_malformed_requests_are_client_errors_naming_the_input(server):
    """20 requests of each of the 17 kinds per protocol; ready after; valid answers bit-identical."""
    result = reliability.storm(server, count=20 * len(reliability.KINDS), seed=SEED)
    assert set(result["kinds"]) == set(reliability.KINDS)
    assert not result["failures"], f"seed {SEED}: {len(result['failures'])} wrong answers, e.g. {result['failures'][:5]}"
    assert result["http_bit_identical_after"] and result["grpc_bit_identical_after"]


def test_exception_inside_execute_is_a_500_naming_the_model_without_internals(server):
    result = reliability.fault(server)
    assert result["faults"] == 6 and not result["failures"], result


def test_soak_at_70_percent_of_peak(server):
    result = reliability.soak(server, seconds=60, fraction=0.7, peak_seconds=8)
    assert result["requests"] > 0 and not result["failures"], result


def test_a_broken_model_stops_the_server_with_a_message_naming_it():
    result = reliability.broken("ikbo_interaction")
    assert result["refused"] and not result["failures"], result
