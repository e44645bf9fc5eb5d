#!/usr/bin/env python3
"""Probe a running tritonserver of this repository: first-request latency, per-model server times,
Triton compilations on the request path.

    python scripts/serving_probe.py first --url localhost:8001 --model ikbo_ranker [--profile large]
    python scripts/serving_probe.py stats --url localhost:8000 [--metrics-url localhost:8002]
    python scripts/serving_probe.py equal-load --url localhost:8001 --rates 50 100 [--profile large]
    python scripts/serving_probe.py in-process --config large --model ikbo_ranker baseline_ranker

`first`: right after the server is ready, one request (U, B of --users/--candidates, gRPC, on a
connection opened by a readiness call first) timed alone, then --repeats more: prints the first
latency, the steady p50 and their ratio (issue 5: first ≤ 2× p50). Each request is drawn fresh
(`make_request`, never zeros).
`stats`: Triton's statistics API (/v2/models/<m>/stats, cumulative since start) as the mean per
executed request of queue, compute input, compute infer and compute output, per model, the mean
wall time inside `execute` per execution (`ikbo_execute_seconds_total`, IKBO models: compute infer
minus it is the python backend's IPC), and the `ikbo_triton_compilations_total` counters of the
metrics endpoint (phase "request" must be 0).
`equal-load`: latency of the rankers at the same offered load (perf_analyzer `--request-rate-range`,
gRPC, the mix's perf_configs file), rankers back to back per rate: achieved requests/s, p50, p99,
and the p99 ratio IKBO / baseline (issue 5: ≤ 1/3 at the same offered load); with --http-url also
each model's server compute time (input + infer + output) and wall time inside execute during its step.
`in-process`: the served model's own call, no server: the python model built from its config file
(`configs/<config>.pbtxt`) the way the python backend builds it (`from_triton_args`: weights, warm-up,
CUDA graphs), then --repeats calls on fresh requests, host memory in and out, as `execute` makes
them: p50 and mean wall ms (the call ends with the scores in host memory, so it waits for the
device). Issue 5 compares the server's compute time of the model with this (≤ 1.5×).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ikbo_backend.metrics import PUSH_PERIOD_S
from ikbo_backend.ranker import PROFILES
from ikbo_backend.requests import make_request

STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


def first_request(url: str, model: str, profile: str, users: int, candidates: int, repeats: int, seed: int) -> dict:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    cfg, rng = PROFILES[profile], np.random.default_rng(seed)
    client = grpcclient.InferenceServerClient(url)

    def once() -> float:
        request = make_request(cfg, users, candidates, rng)
        inputs = []
        for name, array in request.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(np.ascontiguousarray(array))
            inputs.append(tensor)
        start = time.perf_counter()
        scores = client.infer(model, inputs).as_numpy("scores")
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


def model_stats(http_url: str) -> list[dict]:
    """Per model and version: executed requests and mean ms per request of each server stage."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=10) as response:
        document = json.load(response)
    rows = []
    for entry in document.get("model_stats", []):
        inference = entry["inference_stats"]
        count = int(inference["success"]["count"])
        if not count:
            continue
        row = {"model": entry["name"], "requests": count, "executions": int(entry.get("execution_count", 0))}
        for stage in STAGES:
            row[f"{stage}_ms"] = int(inference[stage]["ns"]) / count / 1e6
        rows.append(row)
    return rows


def execute_seconds(metrics_url: str) -> dict[str, float]:
    """ikbo_execute_seconds_total by model (summed over devices): wall time inside execute."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ikbo_execute_seconds_total{"):
            labels, value = line.rsplit(" ", 1)
            model = re.search(r'model="([^"]*)"', labels)
            found[model.group(1) if model else "?"] = found.get(model.group(1) if model else "?", 0.0) + float(value)
    return found


def compilations(metrics_url: str) -> dict[str, float]:
    """ikbo_triton_compilations_total by (model, phase)."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("ikbo_triton_compilations_total{"):
            labels, value = line.rsplit(" ", 1)
            model = re.search(r'model="([^"]*)"', labels)
            phase = re.search(r'phase="([^"]*)"', labels)
            found[f"{model.group(1) if model else '?'}:{phase.group(1) if phase else '?'}"] = float(value)
    return found


def load_served(model: str, config: str):
    """The python model `model` built from configs/<config>.pbtxt as the python backend builds it."""
    import torch
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from ikbo_backend.serving import MODEL_REPOSITORY, RankerModel

    path = MODEL_REPOSITORY / model / ("config.pbtxt" if config == "config" else f"configs/{config}.pbtxt")
    parsed = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    if parsed.backend not in ("python", "python_inprocess"):
        raise SystemExit(f"{path}: not a python model (an ensemble has no in-process call of its own)")
    gpu = any(g.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU for g in parsed.instance_group)
    args = {
        "model_config": json.dumps(json_format.MessageToDict(parsed, preserving_proto_field_name=True)),
        "model_name": model, "model_repository": str(MODEL_REPOSITORY / model),
        "model_instance_kind": "GPU" if gpu and torch.cuda.is_available() else "CPU", "model_instance_device_id": "0",
    }  # fmt: skip
    return RankerModel.from_triton_args(args)


def in_process(
    model: str, config: str, users: int, candidates: int, repeats: int, seed: int | None, gap_ms: float = 0.0
) -> dict:
    """Wall ms of `model`'s python-model call in this process (see the module docstring), with
    `gap_ms` of sleep between calls (a server's cadence: on the H200 host the call's host work ran
    2-3x slower with 3-10 ms gaps than back to back, docs/perf.md)."""
    import torch

    from ikbo_backend.requests import to_tensors

    cuda = torch.cuda.is_available()
    reserved = torch.cuda.memory_reserved() if cuda else 0
    start = time.perf_counter()
    served = load_served(model, config)
    load_s = time.perf_counter() - start
    load_mib = (torch.cuda.memory_reserved() - reserved) / 2**20 if cuda else float("nan")
    rng = np.random.default_rng(seed)
    pool = [to_tensors(make_request(served.cfg, users, candidates, rng)) for _ in range(8)]
    times = []
    with torch.inference_mode():
        for i in range(repeats + 5):
            begin = time.perf_counter()
            scores = served(pool[i % len(pool)])["scores"]
            if i >= 5:  # the first calls settle allocator and caches
                times.append((time.perf_counter() - begin) * 1e3)
            if gap_ms:
                time.sleep(gap_ms / 1e3)
    if scores.shape != (candidates, served.cfg.tasks) or not torch.isfinite(scores).all():
        raise RuntimeError(f"{model}: bad scores {tuple(scores.shape)}")
    return {
        "model": model,
        "p50_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
        "load_s": load_s,
        "load_mib": load_mib,
        "repeats": repeats,
    }


METRICS_SETTLE_S = 2 * PUSH_PERIOD_S  # in process, metric updates reach /metrics within one push period


def server_snapshot(http_url: str, metrics_url: str) -> dict[str, dict]:
    """Cumulative Triton statistics (ns, counts) and ikbo_execute_seconds_total per model."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=10) as response:
        document = json.load(response)
    inside = execute_seconds(metrics_url)
    snapshot = {}
    for entry in document.get("model_stats", []):
        inference = entry["inference_stats"]
        snapshot[entry["name"]] = {
            "requests": int(inference["success"]["count"]), "executions": int(entry.get("execution_count", 0)),
            **{stage: int(inference[stage]["ns"]) for stage in STAGES}, "execute_s": inside.get(entry["name"]),
        }  # fmt: skip
    return snapshot


def server_times(before: dict, after: dict, model: str) -> dict:
    """Mean ms per request of each server stage of `model` between two snapshots, and the mean wall
    ms inside execute per execution; compute = compute input + infer + output."""
    a, b = after.get(model), before.get(model, {})
    requests = a["requests"] - b.get("requests", 0) if a else 0
    if not requests:
        return {}
    times = {f"{stage}_ms": (a[stage] - b.get(stage, 0)) / requests / 1e6 for stage in STAGES}
    times["compute_ms"] = times["compute_input_ms"] + times["compute_infer_ms"] + times["compute_output_ms"]
    executions = a["executions"] - b.get("executions", 0)
    exported = a["execute_s"] is not None and executions  # ikbo_execute_seconds_total: python models of this repo
    times["execute_ms"] = (
        (a["execute_s"] - (b.get("execute_s") or 0.0)) * 1e3 / executions if exported else float("nan")
    )
    return times


def idle_cost(gaps_ms: list[float], repeats: int, profile: str, seed: int | None) -> list[dict]:
    """Fixed work right after `gap` ms of sleep, median ms per gap: host (validate_request of a fresh
    15:1024 request of `profile`: numpy, one thread) and, where there is CUDA, device (16 bf16
    2048³ matmuls on random operands, timed by CUDA events, enqueued right after the sleep)."""
    import torch

    from ikbo_backend.requests import to_tensors, validate_request
    from ikbo_backend.serving import load_shape_ranges

    cfg, ranges, rng = PROFILES[profile], load_shape_ranges(), np.random.default_rng(seed)
    requests = [to_tensors(make_request(cfg, 15, 1024, rng)) for _ in range(4)]
    cuda = torch.cuda.is_available()
    if cuda:
        a, b = (torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for gap in gaps_ms:
        host, device = [], []
        for i in range(repeats + 3):
            time.sleep(gap / 1e3)
            start = time.perf_counter()
            validate_request(cfg, ranges, requests[i % len(requests)])
            host_ms = (time.perf_counter() - start) * 1e3
            if cuda:
                time.sleep(gap / 1e3)
                begin.record()
                for _ in range(16):
                    torch.mm(a, b)
                end.record()
                end.synchronize()
            if i >= 3:
                host.append(host_ms)
                device.append(begin.elapsed_time(end) if cuda else float("nan"))
        rows.append({"gap_ms": gap, "host_ms": statistics.median(host), "device_ms": statistics.median(device)})
    return rows


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
    from perf_sweep import SHORT, Result, run_perf_analyzer, to_result

    from ikbo_backend.perf.inputs import DEFAULT_DIR, ensure_config

    cfg = PROFILES[profile]
    input_data = ensure_config(mix, DEFAULT_DIR if profile == "demo" else DEFAULT_DIR / profile, cfg)
    settings = SHORT.__class__(SHORT.mixes, SHORT.concurrency, window_ms=window_ms, stability_pct=20, max_trials=5)
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
            result: Result = to_result(model, mix, "grpc", 0, 0, row, mode, status)
            rows.append(
                {
                    "rate": rate,
                    "model": model,
                    "achieved": result.infer_per_s,
                    "p50": result.p50_ms,
                    "p99": result.p99_ms,
                    "status": status,
                    "server": server,
                }
            )
            print(
                f"{name}: {result.infer_per_s:.1f} req/s p50 {result.p50_ms:.1f} p99 {result.p99_ms:.1f} ms ({status})",
                file=sys.stderr,
                flush=True,
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    first = sub.add_parser("first", help="first-request latency vs steady p50 (gRPC)")
    first.add_argument("--url", required=True, help="gRPC host:port")
    first.add_argument("--model", nargs="+", default=["ikbo_ranker"])
    first.add_argument("--profile", default="demo", choices=sorted(PROFILES))
    first.add_argument("--users", type=int, default=15)
    first.add_argument("--candidates", type=int, default=1024)
    first.add_argument("--repeats", type=int, default=20)
    first.add_argument("--seed", type=int, default=None)
    stats = sub.add_parser("stats", help="per-model server times and compilation counters")
    stats.add_argument("--url", required=True, help="HTTP host:port")
    stats.add_argument("--metrics-url", help="metrics host:port (default: the HTTP port + 2)")
    load = sub.add_parser("equal-load", help="p50/p99 of the rankers at the same offered load (gRPC)")
    load.add_argument("--url", required=True, help="gRPC host:port")
    load.add_argument("--profile", default="demo", choices=sorted(PROFILES))
    load.add_argument("--mix", default="u15_b1024")
    load.add_argument("--rates", nargs="+", type=float, required=True, help="offered requests/s")
    load.add_argument(
        "--models",
        nargs="+",
        default=["baseline_ranker", "ikbo_ranker"],
        help="the first is the reference of the ratio",
    )
    load.add_argument("--window-ms", type=int, default=3000)
    load.add_argument("--http-url", help="HTTP host:port: also the server's compute time per model and step")
    load.add_argument("--metrics-url", help="metrics host:port (default: the HTTP port + 2)")
    load.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "equal_load")
    local = sub.add_parser("in-process", help="wall ms of the served python model's own call, no server")
    local.add_argument("--config", default="large", help="configs/<name>.pbtxt ('config': config.pbtxt)")
    local.add_argument("--model", nargs="+", default=["baseline_ranker", "ikbo_ranker"])
    local.add_argument("--users", type=int, default=15)
    local.add_argument("--candidates", type=int, default=1024)
    local.add_argument("--repeats", type=int, default=200)
    local.add_argument("--seed", type=int, default=None)
    local.add_argument("--gap-ms", type=float, nargs="+", default=[0.0], help="sleep between calls (one row per value)")
    idle = sub.add_parser("idle", help="fixed host and device work after idle gaps")
    idle.add_argument("--gap-ms", type=float, nargs="+", default=[0.0, 1.0, 3.0, 10.0, 20.0])
    idle.add_argument("--profile", default="large", choices=sorted(PROFILES))
    idle.add_argument("--repeats", type=int, default=50)
    idle.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    if args.command == "idle":
        print("| gap ms | host: validate 15:1024, ms | device: 16 bf16 2048³ matmuls, ms |\n|---:|---:|---:|")
        for r in idle_cost(args.gap_ms, args.repeats, args.profile, args.seed):
            print(f"| {r['gap_ms']:g} | {r['host_ms']:.3f} | {r['device_ms']:.3f} |", flush=True)
        return

    if args.command == "in-process":
        print(
            f"| model (configs/{args.config}.pbtxt, in process) | U | B | gap ms | p50 ms | mean ms | load + warm-up s | GPU MiB reserved by the load |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for model in args.model:
            for gap in args.gap_ms:
                r = in_process(model, args.config, args.users, args.candidates, args.repeats, args.seed, gap)
                print(
                    f"| {model} | {args.users} | {args.candidates} | {gap:g} | {r['p50_ms']:.3f} | {r['mean_ms']:.3f} | {r['load_s']:.1f} | {r['load_mib']:,.0f} |",
                    flush=True,
                )
        return

    if args.command == "equal-load":
        rows = equal_load(
            args.url,
            args.profile,
            args.mix,
            args.rates,
            args.models,
            args.window_ms,
            args.out,
            args.http_url,
            args.metrics_url,
        )
        reference = args.models[0]
        print(
            f"| offered req/s | model | achieved req/s | p50 ms | p99 ms | p99 / {reference} p99 | server compute ms (input / infer / output) | inside execute ms |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            base = next(b for b in rows if b["rate"] == r["rate"] and b["model"] == reference)
            server = r["server"]
            stages = "/".join(f"{server[f'compute_{stage}_ms']:.3f}" for stage in ("input", "infer", "output"))
            compute = (
                f"{server['compute_ms']:.3f} ({stages}) | "
                + ("–" if server["execute_ms"] != server["execute_ms"] else f"{server['execute_ms']:.3f}")
                if server
                else "– | –"
            )
            print(
                f"| {r['rate']:g} | {r['model']} | {r['achieved']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['p99'] / base['p99']:.2f} | {compute} |"
                + ("" if r["status"] == "ok" else f" {r['status']}")
            )
        return
    if args.command == "first":
        print("| model | first request ms | steady p50 ms | first / p50 |\n|---|---:|---:|---:|")
        for model in args.model:
            r = first_request(args.url, model, args.profile, args.users, args.candidates, args.repeats, args.seed)
            print(f"| {model} | {r['first_ms']:.1f} | {r['p50_ms']:.1f} | {r['ratio']:.2f} |", flush=True)
        return
    host, port = args.url.rsplit(":", 1)
    metrics_url = args.metrics_url or f"{host}:{int(port) + 2}"
    inside = execute_seconds(metrics_url)
    print(
        "| model | requests | executions | queue ms | compute input ms | compute infer ms | compute output ms | inside execute ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in model_stats(args.url):
        execute = (
            f"{inside[r['model']] * 1e3 / r['executions']:.3f}" if r["model"] in inside and r["executions"] else "–"
        )
        print(
            f"| {r['model']} | {r['requests']} | {r['executions']} | {r['queue_ms']:.3f} | {r['compute_input_ms']:.3f} "
            f"| {r['compute_infer_ms']:.3f} | {r['compute_output_ms']:.3f} | {execute} |"
        )
    print("\n(compute times: mean per request; inside execute: mean per execution, from ikbo_execute_seconds_total)")
    counts = compilations(metrics_url)
    print(
        "\nikbo_triton_compilations_total: "
        + (", ".join(f"{k} = {v:g}" for k, v in sorted(counts.items())) or "none exported")
    )


if __name__ == "__main__":
    main()
