"""Custom Prometheus metrics (ikbo_backend/metrics.py): the byte count against what the baseline
really replicates, the recording through a stand-in for pb_utils, and the values a real tritonserver
shows on its metrics port after known requests to the batch (ikbo_ranker → ikbo_interaction) and
online (ikbo_ranker_online) endpoints — among them the Triton compilations during requests: 0 (on a
GPU the warm-up's count must be positive, so the counter is live)."""

import re
import secrets
import threading
import time
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from stand_ins import MetricFamily

from ikbo_backend.client import client_module, infer_inputs, infer_scores
from ikbo_backend.compile_counter import CompileCounter
from ikbo_backend.metrics import (
    CANDIDATES_PER_USER_BUCKETS,
    RankerMetrics,
    broadcast_bytes_avoided,
    replicated_row_bytes,
)
from ikbo_backend.online import split_by_user
from ikbo_backend.ranker import RankerConfig, make_demo_weights
from ikbo_backend.synthetic import make_online_batch, make_request, to_tensors
from ikbo_backend.tritonserver import has_gpu, running_tritonserver
from ikbo_backend.variants import build_ranker

SEED = secrets.randbits(32)
CFG = RankerConfig()

pytestmark = pytest.mark.timeout(600)


def test_row_bytes_are_what_the_baseline_replicates_per_candidate():
    """BaselineRanker index_selects user_tokens, history_tokens and history_len to B rows."""
    features = build_ranker("baseline", CFG, make_demo_weights(CFG))[0](
        **to_tensors(make_request(CFG, 3, 10, np.random.default_rng(SEED)))
    )
    replicated = (features.user_tokens, features.history_tokens, features.history_len)
    assert (
        replicated_row_bytes(CFG) == sum(t[0].numel() * t.element_size() for t in replicated) == (10 + 64) * 64 * 4 + 4
    )
    assert replicated_row_bytes(CFG, torch.bfloat16) == (10 + 64) * 64 * 2 + 4
    assert broadcast_bytes_avoided(15, 1024, 100) == 1009 * 100
    assert broadcast_bytes_avoided(4, 4, 100) == 0


def test_record_through_the_metric_families():
    metrics = RankerMetrics(SimpleNamespace(MetricFamily=MetricFamily), "m", row_bytes=10)
    metrics.record(4, 100)
    metrics.record(1, 1)
    assert metrics.candidates.values == [100, 1] and metrics.users.values == [4, 1]
    assert metrics.ratio.values == [25, 1] and metrics.ratio.buckets == list(CANDIDATES_PER_USER_BUCKETS)
    assert metrics.avoided.values == [960, 0]
    assert {m.family.kind for m in (metrics.candidates, metrics.users, metrics.avoided)} == {"counter"}
    assert metrics.ratio.family.kind == "histogram" and metrics.candidates.labels == {"model": "m"}
    metrics.record_execute(0.25)
    metrics.record_execute(0.5)
    assert metrics.execute_seconds.values == [0.25, 0.5] and metrics.execute_seconds.family.kind == "counter"


def test_background_updates_are_pushed_by_the_worker_and_nothing_is_lost():
    """In process (pb_utils.IN_SERVER_PROCESS) the updates leave the request path: the worker pushes
    what gathered in a period (counters summed, one histogram observation per batch, in order);
    flush pushes now, close pushes the rest and ends the worker. Records from 4 threads at once."""
    rng = np.random.default_rng(SEED)
    batches = [(int(u), int(u + rng.integers(0, 2000))) for u in rng.integers(1, 64, size=400)]
    metrics = RankerMetrics(SimpleNamespace(MetricFamily=MetricFamily, IN_SERVER_PROCESS=True), "m", row_bytes=7)
    for users, candidates in batches[:100]:
        metrics.record(users, candidates)
    deadline = time.monotonic() + 5
    while sum(metrics.candidates.values) != sum(b for _, b in batches[:100]) and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker pushes within a period
    assert sum(metrics.candidates.values) == sum(b for _, b in batches[:100])
    assert len(metrics.candidates.values) < 100 and metrics.candidates.threads == {"metrics m"}  # summed per period
    threads = [
        threading.Thread(target=lambda part: [metrics.record(*batch) for batch in part], args=(batches[i::4],))
        for i in range(100, 104)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    metrics.record_execute(0.125)
    metrics.close()
    assert not metrics._worker.is_alive()
    assert sum(metrics.candidates.values) == sum(b for _, b in batches) and sum(metrics.users.values) == sum(
        u for u, _ in batches
    )
    assert sorted(metrics.ratio.values) == sorted(b / u for u, b in batches) and metrics.ratio.values[:100] == [
        b / u for u, b in batches[:100]
    ]
    assert sum(metrics.avoided.values) == sum((b - u) * 7 for u, b in batches) and metrics.execute_seconds.values == [
        0.125
    ]
    inline = RankerMetrics(
        SimpleNamespace(MetricFamily=MetricFamily), "m", row_bytes=7
    )  # the python backend's stub: in place
    inline.record(2, 5)
    assert inline.candidates.values == [5.0] and inline.candidates.threads == {threading.current_thread().name}


def test_instances_on_different_devices_count_apart():
    """Label `device`: two GPU instances of one model are two series (per-GPU rates)."""
    on = {
        d: RankerMetrics(SimpleNamespace(MetricFamily=MetricFamily), "m", 10, device=torch.device(d))
        for d in ("cuda:0", "cuda:1")
    }
    assert [on[d].candidates.labels for d in on] == [
        {"model": "m", "device": "cuda:0"},
        {"model": "m", "device": "cuda:1"},
    ]
    assert {m.labels["device"] for m in (on["cuda:1"].users, on["cuda:1"].ratio, on["cuda:1"].avoided)} == {"cuda:1"}


def test_compile_counter_counts_by_phase_and_keeps_an_earlier_hook(monkeypatch):
    from triton import knobs

    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kwargs: earlier.append(kwargs["fn"].name))
    counter = CompileCounter.install()
    compiled = SimpleNamespace(name="_lce_tile_kernel")
    knobs.runtime.jit_post_compile_hook(fn=compiled, key=None)  # what triton.runtime.jit calls after a compilation
    counter.phase = "request"
    knobs.runtime.jit_post_compile_hook(fn=compiled, key=None)
    assert counter.counts == {"warmup": 1, "request": 1} and earlier == ["_lce_tile_kernel"] * 2
    metrics = RankerMetrics(SimpleNamespace(MetricFamily=MetricFamily), "m", row_bytes=10, compilations=counter)
    assert [m.values for m in metrics._compiled_metrics.values()] == [[1], [1]]
    metrics.record(1, 2)  # nothing new: nothing added
    assert [m.values for m in metrics._compiled_metrics.values()] == [[1], [1]]


def test_compile_counter_leaves_compilations_during_another_models_load_uncounted(monkeypatch):
    """Several models in one process (python_inprocess): while the backend says a load is in progress,
    a compilation belongs to the loading model, not to this model's request path."""
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    loads = [0]
    counter = CompileCounter.install(lambda: loads[0])
    counter.phase = "request"
    compiled = SimpleNamespace(name="_lce_tile_kernel")
    loads[0] = 1
    knobs.runtime.jit_post_compile_hook(fn=compiled, key=None)
    assert counter.counts == {"warmup": 0, "request": 0}
    loads[0] = 0
    knobs.runtime.jit_post_compile_hook(fn=compiled, key=None)
    assert counter.counts == {"warmup": 0, "request": 1}


# ------------------------------------------------------------------ with a real tritonserver


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "tritonserver.log"
    load = ["--model-control-mode=explicit", "--load-model=ikbo_ranker", "--load-model=ikbo_ranker_online"]
    with running_tritonserver(config_name="gpu" if has_gpu() else None, log_path=log_path, extra_args=load) as running:
        yield running


def ikbo_samples(server) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every ikbo_* sample on the metrics port."""
    text = urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10).read().decode()
    samples = []
    for line in text.splitlines():
        match = re.match(r"^(ikbo_\w+)\{([^}]*)\} (\S+)$", line)
        if match:
            samples.append(
                (match.group(1), dict(re.findall(r'(\w+)="([^"]*)"', match.group(2))), float(match.group(3)))
            )
    return samples


def scrape(server) -> dict[tuple[str, str], float]:
    """(sample name, model label) → value of every ikbo_* sample, summed over instances (label
    `device`: a GPU config puts one instance on every GPU); histogram buckets as name + '{le}'."""
    samples = {}
    for name, labels, value in ikbo_samples(server):
        extra = labels.get("le", labels.get("phase"))
        key = (name + (f"{{{extra}}}" if extra is not None else ""), labels["model"])
        samples[key] = samples.get(key, 0.0) + value
    return samples


def expected(batches: list[tuple[int, int]], model: str) -> dict[tuple[str, str], float]:
    row = replicated_row_bytes(CFG)
    values = {
        "ikbo_candidates_scored_total": sum(b for _, b in batches),
        "ikbo_users_scored_total": sum(u for u, _ in batches),
        "ikbo_broadcast_bytes_avoided_total": sum((b - u) * row for u, b in batches),
        "ikbo_candidates_per_user_count": len(batches),
        "ikbo_candidates_per_user_sum": sum(b / u for u, b in batches),
    }
    for le in CANDIDATES_PER_USER_BUCKETS:
        values[f"ikbo_candidates_per_user_bucket{{{le}}}"] = sum(b / u <= le for u, b in batches)
    return {(name, model): value for name, value in values.items()}


def test_metrics_after_known_requests(server):
    """Requests one at a time, so every online request is a batch of its own. The values are read as
    differences from the start: the GPU configs' `model_warmup` requests count (on the CPU nothing has
    run before the test), and in process (GPU configs) the updates land within 50 ms (polled)."""
    batch_model = "ikbo_ranker" if has_gpu() else "ikbo_interaction"  # the GPU configs serve one model
    module = client_module("grpc")
    connection = module.InferenceServerClient(server.grpc_url)
    try:
        at_start = scrape(server)
        if not has_gpu():
            assert not any(name.endswith("_total") and value for (name, _), value in at_start.items()), (
                "warm-up was counted"
            )
        batch_mixes = [(3, 40), (15, 1024), (1, 1)]
        for users, candidates in batch_mixes:
            infer_scores(
                connection,
                module,
                "ikbo_ranker",
                make_request(CFG, users, candidates, np.random.default_rng([SEED, users])),
            )
        online = split_by_user(make_online_batch(CFG, 5, 300, np.random.default_rng(SEED)))
        for one in online:
            connection.infer("ikbo_ranker_online", infer_inputs(module, one))
    finally:
        connection.close()
    online_batches = [(1, one["cand_dense"].shape[1]) for one in online]
    want = expected(batch_mixes, batch_model) | expected(online_batches, "ikbo_ranker_online")
    deadline = time.monotonic() + 5
    while True:
        got = scrape(server)
        change = {key: got.get(key, 0.0) - at_start.get(key, 0.0) for key in want}
        if (
            all(change[key] == pytest.approx(value, rel=1e-6) for key, value in want.items())
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.05)
    warm_up = {}
    for model in (batch_model, "ikbo_ranker_online"):
        warm_up[model], requests = (
            got[(f"ikbo_triton_compilations_total{{{phase}}}", model)] for phase in ("warmup", "request")
        )
        assert requests == 0, f"{model}: {requests} Triton compilations on the request path"
    # GPU: the warm-ups compiled. Both rankers load into tritonserver's own process (python_inprocess) and
    # share its Triton kernel cache, so the one loaded second may find every kernel compiled: the sum
    # counts. CPU: Triton never runs.
    assert (sum(warm_up.values()) > 0) == has_gpu(), f"Triton compilations during the warm-ups: {warm_up}"
    for key, value in want.items():
        assert key in got, f"{key} not on the metrics port"
        assert change[key] == pytest.approx(value, rel=1e-6), f"{key}: {change[key]} != {value} (seed {SEED})"


def test_every_sample_names_its_instance_device(server):
    """Label `device`: "cpu" on the CPU configuration, "cuda:<id>" on a GPU one."""
    devices = {labels.get("device") for _, labels, _ in ikbo_samples(server)}
    assert devices and all(re.fullmatch(r"cuda:\d+" if has_gpu() else "cpu", str(d)) for d in devices), devices
