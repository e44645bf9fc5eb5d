"""ikbo_backend.perf.gpu_throughput (scripts/gpu_throughput.py) on fabricated Prometheus text shaped like tritonserver's /metrics with
two GPU instances per model: per-GPU and total candidates/s from the increments of the IKBO counters
(label `device`), Triton's counts per `gpu_uuid`, counter resets, and the command-window CLI against
a stand-in metrics endpoint."""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ikbo_backend.perf import gpu_throughput
from ikbo_backend.perf.gpu_throughput import report
from ikbo_backend.perf.prometheus import increments, parse_prometheus

GPU0, GPU1 = "GPU-0aa1b2c3-0000-1111-2222-333344445555", "GPU-9ff1b2c3-0000-1111-2222-333344445555"


def metrics_text(c0: float, c1: float, online: float = 0, inferences: tuple = (0, 0)) -> str:
    """ikbo_interaction with an instance on each GPU (c0, c1 candidates scored, batches of 15 users),
    ikbo_ranker_online on GPU 0 only; Triton's counts per gpu_uuid and for the ensemble."""
    n0, n1 = inferences
    return f"""# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{{model="ikbo_ranker",version="1"}} {n0 + n1}
nv_inference_request_success{{gpu_uuid="{GPU0}",model="ikbo_interaction",version="1"}} {n0}
nv_inference_request_success{{gpu_uuid="{GPU1}",model="ikbo_interaction",version="1"}} {n1}
# TYPE nv_inference_count counter
nv_inference_count{{model="ikbo_ranker",version="1"}} {n0 + n1}
nv_inference_count{{gpu_uuid="{GPU0}",model="ikbo_interaction",version="1"}} {n0}
nv_inference_count{{gpu_uuid="{GPU1}",model="ikbo_interaction",version="1"}} {n1}
nv_inference_exec_count{{gpu_uuid="{GPU0}",model="ikbo_interaction",version="1"}} {n0}
nv_inference_exec_count{{gpu_uuid="{GPU1}",model="ikbo_interaction",version="1"}} {n1}
nv_inference_request_failure{{model="ikbo_ranker",reason="OTHER",version="1"}} 0
nv_gpu_utilization{{gpu_uuid="{GPU0}"}} 0.87
nv_cpu_memory_used_bytes 123456789
# HELP ikbo_candidates_scored_total Candidates scored
# TYPE ikbo_candidates_scored_total counter
ikbo_candidates_scored_total{{device="cuda:0",model="ikbo_interaction"}} {c0}
ikbo_candidates_scored_total{{device="cuda:1",model="ikbo_interaction"}} {c1}
ikbo_candidates_scored_total{{device="cuda:0",model="ikbo_ranker_online"}} {online}
ikbo_users_scored_total{{device="cuda:0",model="ikbo_interaction"}} {c0 / 1024 * 15}
ikbo_users_scored_total{{device="cuda:1",model="ikbo_interaction"}} {c1 / 1024 * 15}
ikbo_users_scored_total{{device="cuda:0",model="ikbo_ranker_online"}} {online / 64}
ikbo_candidates_per_user_count{{device="cuda:0",model="ikbo_interaction"}} {c0 / 1024}
ikbo_candidates_per_user_count{{device="cuda:1",model="ikbo_interaction"}} {c1 / 1024}
ikbo_candidates_per_user_count{{device="cuda:0",model="ikbo_ranker_online"}} {online / 640}
ikbo_candidates_per_user_bucket{{device="cuda:0",le="64",model="ikbo_interaction"}} 0
ikbo_candidates_per_user_bucket{{device="cuda:0",le="+Inf",model="ikbo_interaction"}} {c0 / 1024}
ikbo_triton_compilations_total{{device="cuda:1",model="ikbo_interaction",phase="request"}} 0
"""


def test_parse_prometheus_text():
    samples = parse_prometheus(
        metrics_text(2048, 1024, inferences=(2, 1)) + 'odd{path="a \\"quoted\\", b"} NaN 1700000000000\n'
    )
    assert (
        samples[
            ("nv_inference_count", frozenset({("gpu_uuid", GPU1), ("model", "ikbo_interaction"), ("version", "1")}))
        ]
        == 1
    )
    assert samples[("nv_cpu_memory_used_bytes", frozenset())] == 123456789
    bucket = frozenset({("device", "cuda:0"), ("le", "+Inf"), ("model", "ikbo_interaction")})
    assert samples[("ikbo_candidates_per_user_bucket", bucket)] == 2
    assert ("odd", frozenset({("path", 'a \\"quoted\\", b')})) in samples
    with pytest.raises(ValueError, match="not a Prometheus sample line"):
        parse_prometheus("what is this\n")


def test_per_gpu_and_total_candidates_per_second():
    before = parse_prometheus(metrics_text(10 * 1024, 8 * 1024, online=640, inferences=(10, 8)))
    after = parse_prometheus(metrics_text(110 * 1024, 98 * 1024, online=6400, inferences=(110, 98)))
    result = report(before, after, seconds=10.0)
    rows = {(r.model, r.device): r for r in result.devices}
    assert set(rows) == {
        ("ikbo_interaction", "cuda:0"),
        ("ikbo_interaction", "cuda:1"),
        ("ikbo_ranker_online", "cuda:0"),
    }
    assert (
        rows["ikbo_interaction", "cuda:0"].candidates == 100 * 1024
        and rows["ikbo_interaction", "cuda:0"].batches == 100
    )
    assert rows["ikbo_interaction", "cuda:1"].candidates_per_s == pytest.approx(90 * 1024 / 10)
    assert rows["ikbo_interaction", "cuda:1"].users == pytest.approx(90 * 15)
    assert result.per_device() == pytest.approx({"cuda:0": (100 * 1024 + 5760) / 10, "cuda:1": 90 * 1024 / 10})
    assert result.total_candidates_per_s == pytest.approx((190 * 1024 + 5760) / 10)
    triton = {(r.model, r.gpu_uuid): r for r in result.triton}
    assert set(triton) == {("ikbo_ranker", ""), ("ikbo_interaction", GPU0), ("ikbo_interaction", GPU1)}
    assert (triton["ikbo_interaction", GPU1].inferences, triton["ikbo_interaction", GPU1].executions) == (90, 90)
    assert triton["ikbo_ranker", ""].inferences_per_s == pytest.approx(19)
    table = result.markdown()
    assert "| **total** | **" in table and "| cuda:1 | 9,216 | 46% |" in table and GPU0 in table


def test_idle_window_and_counter_reset():
    idle = metrics_text(1024, 1024, inferences=(1, 1))
    assert report(parse_prometheus(idle), parse_prometheus(idle), 5.0).devices == []
    before = parse_prometheus(metrics_text(50 * 1024, 0, inferences=(50, 0)))
    after = parse_prometheus(metrics_text(2 * 1024, 0, inferences=(2, 0)))  # restarted: counts from 0
    series = ("ikbo_candidates_scored_total", frozenset({("device", "cuda:0"), ("model", "ikbo_interaction")}))
    assert increments(before, after)[series] == 2048
    with pytest.raises(ValueError, match="seconds"):
        report(before, after, 0.0)


@pytest.fixture
def metrics_endpoint():
    """A /metrics endpoint whose counters advance when /advance is fetched (the 'load')."""
    state = {"text": metrics_text(1024, 1024, inferences=(1, 1))}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/advance":
                state["text"] = metrics_text(41 * 1024, 21 * 1024, inferences=(41, 21))
            body = state["text"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("localhost", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"localhost:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_cli_measures_around_a_command(metrics_endpoint, tmp_path, capsys):
    load = f"import urllib.request; urllib.request.urlopen('http://{metrics_endpoint}/advance').read()"
    out = tmp_path / "report.json"
    status = gpu_throughput.main(["--url", metrics_endpoint, "--json", str(out), "--", sys.executable, "-c", load])
    assert status == 0
    saved = json.loads(out.read_text())
    assert set(saved["per_device"]) == {"cuda:0", "cuda:1"}
    assert saved["per_device"]["cuda:0"] / saved["per_device"]["cuda:1"] == pytest.approx(2.0)
    assert saved["total_candidates_per_s"] == pytest.approx(60 * 1024 / saved["seconds"])
    assert "### Per-GPU throughput" in capsys.readouterr().out
    assert gpu_throughput.main(["--url", metrics_endpoint, "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
