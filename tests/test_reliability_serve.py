"""Reliability rows of issue 6 that need `make serve` itself (scripts/serve as a subprocess, over a
copy of the rankers' models): hardening (restricted APIs behind the admin header, no model control),
stub kill -9 under load (serve restarts tritonserver), and SIGTERM under load (last: it stops the
server). Long forms: scripts/reliability.py harden|kill|shutdown.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import reliability  # noqa: E402

EXIT_TIMEOUT = 20
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def served():
    with reliability.rankers_repository() as repo, reliability.serving(EXIT_TIMEOUT, repo) as running:
        yield running


def test_restricted_apis_need_the_admin_header(served):
    result = reliability.hardening(served)
    assert not result["failures"], result["failures"]


def test_stub_kill_under_load_recovers_within_30_s_without_shm_leaks(served):
    result = reliability.kill_stubs(served, kills=1, recover_timeout=30)
    assert result["kills"] == 1 and not result["failures"], result


def test_sigterm_under_load_finishes_in_flight_requests_and_exits_0(served):
    result = reliability.graceful_shutdown(served, EXIT_TIMEOUT)
    assert not result["failures"], result
