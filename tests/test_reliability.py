"""Reliability rows, short forms, against one real tritonserver (test-only faults on) over
a copy of the rankers' models: hypothesis-drawn malformed requests of every kind over HTTP and gRPC,
a fault inside execute, a 60 s soak; and a repository with a broken model. The long forms and their
figures: scripts/reliability.py, docs/reliability.md.
"""

import secrets
import sys

import pytest

from ikbo_backend.paths import REPO_ROOT
from ikbo_backend.reliability import soak as soak_row
from ikbo_backend.reliability.broken import broken
from ikbo_backend.reliability.cases import KINDS
from ikbo_backend.reliability.fault import fault, fault_server
from ikbo_backend.reliability.repositories import rankers_repository
from ikbo_backend.reliability.storm import storm

SEED = secrets.randbits(31)
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server():
    with rankers_repository() as repo, fault_server(repo) as running:
        yield running


def test_malformed_requests_are_client_errors_naming_the_input(server):
    """20 requests of each of the 17 kinds per protocol; ready after; valid answers bit-identical."""
    result = storm(server, count=20 * len(KINDS), seed=SEED)
    assert set(result["kinds"]) == set(KINDS)
    assert not result["failures"], (
        f"seed {SEED}: {len(result['failures'])} wrong answers, e.g. {result['failures'][:5]}"
    )
    assert result["http_bit_identical_after"] and result["grpc_bit_identical_after"]


def test_exception_inside_execute_is_a_500_naming_the_model_without_internals(server):
    result = fault(server)
    assert result["faults"] == 6 and not result["failures"], result


def test_soak_at_70_percent_of_peak(server):
    result = soak_row.soak(server, seconds=60, fraction=0.7, peak_seconds=8)
    assert result["requests"] > 0 and not result["failures"], result


def test_soak_reports_gpu_memory_growth(server, monkeypatch):
    """Where there is a GPU the soak samples its memory (nvidia-smi) and fails when it grows by more
    than 64 MiB after mid-run; here a stand-in sampler grows 10 MiB per sample."""
    samples = iter(range(1000, 10**6, 10))
    monkeypatch.setattr(soak_row, "gpu_memory_used_mib", lambda: next(samples))
    result = soak_row.soak(server, seconds=12, fraction=0.5, peak_seconds=2)
    assert result["requests"] > 0 and result["gpu_mib_start"] == 1000
    assert result["gpu_growth_from_mid_mib"] == result["gpu_mib_end"] - result["gpu_mib_mid"] >= 50
    assert [f for f in result["failures"] if f.startswith("GPU memory grew")] == (
        [f"GPU memory grew {result['gpu_growth_from_mid_mib']} MiB from mid-run"]
        if result["gpu_growth_from_mid_mib"] > 64
        else []
    )


def test_soak_attaches_to_a_running_server(server):
    """`reliability.py soak --attach` (the GPU run's soak): the same row against a server it did not start."""
    import json
    import subprocess

    argv = [
        sys.executable,
        str(REPO_ROOT / "scripts" / "reliability.py"),
        "soak",
        "--attach",
        server.http_url,
        "--server-pid",
        str(server.process.pid),
        "--seconds",
        "4",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(line)["soak"]
    assert (
        result["requests"] > 0
        and result["errors"] == 0
        and result["rss_start_mb"] > 100
        and result["profile"] == "demo"
    )


def test_a_broken_model_stops_the_server_with_a_message_naming_it():
    result = broken("ikbo_interaction")
    assert result["refused"] and not result["failures"], result
