"""Client-side latency of the served rankers: the first request against the steady state, and p50 / p99
at the same offered load (perf_analyzer `--request-rate-range`, gRPC), with the server's own times.

Every request is drawn fresh (`make_request`, never zeros).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..client import infer_scores
from ..ranker import PROFILES
from ..synthetic import make_request
from .inputs import DEFAULT_DIR, ensure_config
from .perf_analyzer import Profile, run_perf_analyzer, to_result
from .prometheus import METRICS_SETTLE_S
from .server_stats import server_snapshot, server_times


def first_request(url: str, model: str, profile: str, users: int, candidates: int, repeats: int, seed: int) -> dict:
    """gRPC: one request timed alone on a connection opened by a readiness call, then `repeats` more;
    the first latency, the steady p50 and their ratio."""
    import tritonclient.grpc as grpcclient

    cfg, rng = PROFILES[profile], np.random.default_rng(seed)
    client = grpcclient.InferenceServerClient(url)

    def once() -> float:
        request = make_request(cfg, users, candidates, rng)
        start = time.perf_counter()
        scores = infer_scores(client, grpcclient, model, request)
        elapsed = (time.perf_counter() - start) * 1e3
        if scores.shape != (candidates, cfg.tasks) or not np.isfinite(scores).all():
            raise RuntimeError(f"{model}: bad scores {scores.shape}")
        return elapsed

    try:
        client.is_model_ready(model)  # the connection is set up before the timed request
        first = once()
        steady = [once() for _ in range(repeats)]
    finally:
        client.close()
    p50 = statistics.median(steady)
    return {"model": model, "first_ms": first, "p50_ms": p50, "ratio": first / p50, "repeats": repeats}


def equal_load(
    url: str,
    profile: str,
    mix: str,
    rates: list[float],
    models: list[str],
    window_ms: int,
    out: Path,
    http_url: str | None = None,
    metrics_url: str | None = None,
) -> list[dict]:
    """perf_analyzer at each offered load (requests/s) for each model, back to back; with `http_url`
    also the server's stage times of that model during each step (`metrics_url`: default the HTTP port + 2)."""
    cfg = PROFILES[profile]
    input_data = ensure_config(mix, DEFAULT_DIR if profile == "demo" else DEFAULT_DIR / profile, cfg)
    settings = Profile((mix,), (8,), window_ms=window_ms, stability_pct=20, max_trials=5)
    out.mkdir(parents=True, exist_ok=True)
    if http_url and not metrics_url:
        host, port = http_url.rsplit(":", 1)
        metrics_url = f"{host}:{int(port) + 2}"
    rows = []
    for rate in rates:
        for model in models:
            name = f"{model}.{mix}.rate{rate:g}"
            before = server_snapshot(http_url, metrics_url) if http_url else {}
            row, mode, status = run_perf_analyzer(
                model, url, "grpc", input_data, 8, settings, out / f"{name}.csv", out / f"{name}.log", request_rate=rate
            )
            time.sleep(METRICS_SETTLE_S)
            server = server_times(before, server_snapshot(http_url, metrics_url), model) if http_url else {}
            result = to_result(model, mix, "grpc", 0, 0, row, mode, status)
            rows.append({
                "rate": rate, "model": model, "achieved": result.infer_per_s, "p50": result.p50_ms,
                "p99": result.p99_ms, "status": status, "server": server,
            })  # fmt: skip
            print(
                f"{name}: {result.infer_per_s:.1f} req/s p50 {result.p50_ms:.1f} p99 {result.p99_ms:.1f} ms ({status})",
                file=sys.stderr,
                flush=True,
            )
    return rows


def equal_load_table(rows: list[dict], reference: str) -> str:
    """Markdown: one line per (rate, model), the p99 ratio to `reference` at the same rate."""
    lines = [
        f"| offered req/s | model | achieved req/s | p50 ms | p99 ms | p99 / {reference} p99 "
        "| server compute ms (input / infer / output) | inside execute ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = next(b for b in rows if b["rate"] == r["rate"] and b["model"] == reference)
        server = r["server"]
        compute = "– | –"
        if server:
            stages = "/".join(f"{server[f'compute_{stage}_ms']:.3f}" for stage in ("input", "infer", "output"))
            execute = "–" if server["execute_ms"] != server["execute_ms"] else f"{server['execute_ms']:.3f}"
            compute = f"{server['compute_ms']:.3f} ({stages}) | {execute}"
        lines.append(
            f"| {r['rate']:g} | {r['model']} | {r['achieved']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} "
            f"| {r['p99'] / base['p99']:.2f} | {compute} |" + ("" if r["status"] == "ok" else f" {r['status']}")
        )
    return "\n".join(lines)
