"""perf_analyzer against a real tritonserver: a few seconds on `ikbo_ranker` from a perf_configs file.

The server (CPU, free ports) is started by the test; perf_analyzer comes from tritonclient[all]
(see ikbo_backend.perf.perf_analyzer for how it is found). Passing means: perf_analyzer exits 0, reports
nonzero throughput, and the server counted successful inferences and no failures.
"""

import json
import sys
import time
import urllib.request

import pytest

from ikbo_backend.perf.inputs import ensure_config
from ikbo_backend.perf.perf_analyzer import Profile, run_perf_analyzer
from ikbo_backend.tritonserver import is_ready, running_tritonserver

MODEL = "ikbo_ranker"
MIX = "u15_b1024"
# a fixed count of requests: no stability criterion to miss on a shared CI machine
QUICK = Profile((MIX,), (1,), window_ms=1000, stability_pct=50, max_trials=4, request_count=40)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_tritonserver(log_path=tmp_path_factory.mktemp("server") / "tritonserver.log") as running:
        yield running


def inference_counts(http_url: str) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{MODEL}/stats", timeout=10) as response:
        stats = json.load(response)["model_stats"][0]["inference_stats"]
    return stats["success"]["count"], stats["fail"]["count"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_perf_analyzer_zero_errors(server, protocol, tmp_path):
    input_data = ensure_config(MIX)
    success_before, fail_before = inference_counts(server.http_url)
    row, _, status = run_perf_analyzer(
        MODEL,
        server.grpc_url if protocol == "grpc" else server.http_url,
        protocol,
        input_data,
        concurrency=1,
        profile=QUICK,
        csv_path=tmp_path / "run.csv",
        log_path=tmp_path / "run.log",
        timeout_s=60,
    )
    log = (tmp_path / "run.log").read_text()
    assert status == "ok", f"{status}\n{log[-3000:]}"
    assert float(row["Inferences/Second"]) > 0, log[-3000:]
    success_after, fail_after = inference_counts(server.http_url)
    assert fail_after == fail_before, f"server counted {fail_after - fail_before} failed inferences\n{log[-3000:]}"
    assert success_after > success_before
    assert is_ready(server.http_url)


def test_an_interrupted_sweep_reports_the_runs_it_finished(monkeypatch, tmp_path):
    """SIGTERM / Ctrl-C mid-sweep (a step timeout): the finished runs still reach sweep.csv and the
    table, and the exit status says the sweep is incomplete."""
    import csv

    import ikbo_backend.perf.sweep as perf_sweep

    calls = []

    def fake_run(model, url, protocol, input_data, concurrency, profile, csv_path, log_path, *rest):
        calls.append(model)
        if len(calls) == 2:
            raise KeyboardInterrupt
        row = {"Inferences/Second": "12.5", "p50 latency": "1000", "p90 latency": "2000", "p99 latency": "3000"}
        return row, "windows", "ok"

    monkeypatch.setattr(perf_sweep, "run_perf_analyzer", fake_run)
    argv = ["--url", "localhost:1", "--mixes", "u1_b64", "--protocols", "grpc", "--concurrency", "1", "2",
            "--rankers", "baseline_ranker", "ikbo_ranker", "--configs", str(tmp_path / "configs"), "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(
        (SystemExit, KeyboardInterrupt)
    ) as exit_info:  # an escaping interrupt fails here, not the session
        perf_sweep.main(argv)
    assert exit_info.type is SystemExit and exit_info.value.code == 1 and len(calls) == 2
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["ranker"], r["concurrency"]) for r in rows] == [("baseline_ranker", "1")]
    assert float(rows[0]["candidates_per_s"]) == 12.5 * 64


FAKE_PERF_ANALYZER = """#!{python}
import sys, time
from pathlib import Path
marker = Path({marker!r})
runs = int(marker.read_text()) if marker.exists() else 0
marker.write_text(str(runs + 1))
if runs < {stalls}:
    time.sleep(60)  # a stalled perf_analyzer
out = Path(sys.argv[sys.argv.index("-f") + 1])
out.write_text("Concurrency,Inferences/Second,p50 latency,p90 latency,p99 latency\\n1,{rate},1000,1500,2000\\n")
"""


@pytest.mark.parametrize("stalls", (1, 2))
def test_a_stalled_perf_analyzer_is_run_once_more(monkeypatch, tmp_path, stalls):
    """run_perf_analyzer kills a perf_analyzer that outlives its limit and runs it once more: one stall
    costs one limit and the measurement stands; two stalls are an error that says so."""
    fake = tmp_path / "perf_analyzer"
    rate = 12.5 + stalls
    fake.write_text(
        FAKE_PERF_ANALYZER.format(python=sys.executable, marker=str(tmp_path / "runs"), stalls=stalls, rate=rate)
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PERF_ANALYZER", str(fake))
    start = time.monotonic()
    row, _, status = run_perf_analyzer(
        MODEL, "localhost:1", "grpc", tmp_path / "data.json", concurrency=1, profile=QUICK,
        csv_path=tmp_path / "run.csv", log_path=tmp_path / "run.log", timeout_s=2,
    )  # fmt: skip
    log = (tmp_path / "run.log").read_text()
    assert (tmp_path / "runs").read_text() == "2" and 2 * stalls <= time.monotonic() - start < 30
    assert "timed out after 2 s (attempt 1 of 2)" in log
    if stalls == 1:
        assert status == "ok" and float(row["Inferences/Second"]) == rate, log
    else:
        assert row is None and status.startswith("error") and "timed out after 2 s (attempt 2 of 2)" in log, status


@pytest.mark.timeout(120)
def test_request_rate_mode_offers_the_asked_load(server, tmp_path):
    """`--request-rate-range` (serving_probe equal-load): perf_analyzer sends at the given rate, so
    the achieved rate matches it when the server keeps up; every request succeeds."""
    success_before, fail_before = inference_counts(server.http_url)
    row, _, status = run_perf_analyzer(
        MODEL, server.grpc_url, "grpc", ensure_config("u1_b64"), concurrency=1, profile=QUICK,
        csv_path=tmp_path / "run.csv", log_path=tmp_path / "run.log", timeout_s=45, request_rate=8,
    )  # fmt: skip
    log = (tmp_path / "run.log").read_text()
    assert status == "ok", f"{status}\n{log[-3000:]}"
    assert "--request-rate-range 8:8" in log and "--concurrency-range" not in log
    assert 6 <= float(row["Inferences/Second"]) <= 10, log[-3000:]
    assert float(row["p99 latency"]) >= float(row["p50 latency"]) > 0
    success_after, fail_after = inference_counts(server.http_url)
    assert fail_after == fail_before and success_after >= success_before + QUICK.request_count


@pytest.mark.timeout(120)
def test_server_times_between_snapshots_count_only_that_step(server):
    """server_stats.server_times (equal-load --http-url): the stage times of the requests sent
    between two snapshots, per request, and the wall time inside execute per execution."""
    import numpy as np

    from ikbo_backend.client import client_module, infer_inputs
    from ikbo_backend.perf import server_stats
    from ikbo_backend.ranker import RankerConfig
    from ikbo_backend.synthetic import make_request

    metrics_url = server.metrics_url
    before = server_stats.server_snapshot(server.http_url, metrics_url)
    module = client_module("http")
    client = module.InferenceServerClient(server.http_url)
    rng = np.random.default_rng()
    for _ in range(3):
        client.infer(MODEL, infer_inputs(module, make_request(RankerConfig(), 3, 40, rng)))
    client.close()
    deadline = time.monotonic() + 10  # the python backend reports a step's statistics after sending its response
    while True:
        after = server_stats.server_snapshot(server.http_url, metrics_url)
        if (
            after["ikbo_interaction"]["requests"] - before.get("ikbo_interaction", {}).get("requests", 0) >= 3
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.05)
    assert after["ikbo_interaction"]["requests"] - before.get("ikbo_interaction", {}).get("requests", 0) == 3
    times = server_stats.server_times(before, after, "ikbo_interaction")
    assert times["compute_ms"] == pytest.approx(
        times["compute_input_ms"] + times["compute_infer_ms"] + times["compute_output_ms"]
    )
    assert 0 < times["execute_ms"] < times["compute_ms"] * 3  # one request per execution here
    assert server_stats.server_times(after, after, "ikbo_interaction") == {}
    ensemble = server_stats.server_times(before, after, MODEL)  # no execute of its own
    assert ensemble["compute_ms"] > 0 and ensemble["execute_ms"] != ensemble["execute_ms"]
